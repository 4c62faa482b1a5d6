"""The `duplex` console script is installed and refuses what it cannot do, clearly."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness.redis_server import free_port
from services.cli import EXIT_NOT_AVAILABLE, main


def duplex_executable() -> str:
    beside_python = Path(sys.executable).with_name("duplex")
    return str(beside_python) if beside_python.exists() else (shutil.which("duplex") or "")


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    environment.update(env or {})
    return subprocess.run(
        [duplex_executable(), *args], capture_output=True, text=True, timeout=60, env=environment
    )


def test_console_script_is_installed_and_documents_itself():
    assert duplex_executable(), "the duplex console script is not installed"
    result = run("--help")
    assert result.returncode == 0
    for command in ("serve", "api", "worker", "sessions"):
        assert command in result.stdout


def test_api_and_worker_need_a_real_redis():
    for command in (["api"], ["worker", "--plugin", "echo"]):
        result = run(*command)
        assert result.returncode != 0
        assert "needs DUPLEX_REDIS_URL" in result.stderr


def test_admin_commands_need_a_real_redis(capsys, monkeypatch):
    monkeypatch.delenv("DUPLEX_REDIS_URL", raising=False)
    assert main(["sessions", "ls"]) == EXIT_NOT_AVAILABLE
    err = capsys.readouterr().err
    assert "needs DUPLEX_REDIS_URL" in err
    # and says how to get one: a redis-server under `make serve` (docs/operations.md)
    assert "redis-server" in err and "make serve" in err and "docs/operations.md" in err
    assert main(["workers"]) == EXIT_NOT_AVAILABLE


#: what an admin command must not load: the servers, the wire codec's numpy, the models
HEAVY = {"fastapi", "starlette", "uvicorn", "pydantic", "numpy", "soxr", "onnxruntime", "plugins"}


def test_admin_commands_import_only_what_they_need(redis_server):
    """`duplex sessions ...` and `duplex workers` read Redis: they must start fast, so they
    import neither the API nor the worker (docs/operations.md has the start time)."""
    code = (
        "import sys\n"
        "from services.cli import main\n"
        "for argv in (['sessions', 'ls'], ['sessions', 'show', 'duplex-x'],"
        " ['sessions', 'tail', 'duplex-x'], ['sessions', 'close', 'duplex-x'], ['workers']):\n"
        "    main(argv)\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    environment["DUPLEX_REDIS_URL"] = redis_server.url
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
    )
    assert result.returncode == 0, result.stderr
    loaded = set(result.stdout.splitlines()[-1].split())
    assert "redis" in loaded and "services" in loaded  # it did run the commands
    assert not loaded & HEAVY, loaded & HEAVY


def test_admin_usage_errors_and_an_unreachable_redis_are_clear(redis_server):
    bad_lines = run(
        "sessions", "tail", "duplex-x", "-n", "-1", env={"DUPLEX_REDIS_URL": redis_server.url}
    )
    assert bad_lines.returncode == 2 and "-n needs N >= 0" in bad_lines.stderr
    no_id = run("sessions", "tail", env={"DUPLEX_REDIS_URL": redis_server.url})
    assert no_id.returncode == 2 and "needs a session id" in no_id.stderr
    closed_port = f"redis://127.0.0.1:{free_port()}/0"
    unreachable = run("sessions", "ls", env={"DUPLEX_REDIS_URL": closed_port})
    assert unreachable.returncode == EXIT_NOT_AVAILABLE
    assert unreachable.stderr.startswith(f"cannot reach Redis ({closed_port})")
    assert "Traceback" not in unreachable.stderr


def test_model_dir_and_plugin_options_on_worker_and_serve():
    from services.cli import build_parser

    for command in ("worker", "serve"):
        options = ["--plugin-option", "preset=personaplex", "--plugin-option", "device=cuda:1"]
        args = build_parser().parse_args([command, "--model-dir", "/m", *options])
        assert args.model_dir == "/m"
        assert dict(args.plugin_option) == {"preset": "personaplex", "device": "cuda:1"}


def test_a_malformed_plugin_option_is_refused_clearly():
    result = run("worker", "--plugin", "echo", "--plugin-option", "preset")
    assert result.returncode == 2
    assert "--plugin-option: 'preset' is not KEY=VALUE" in result.stderr
    result = run("worker", "--plugin", "echo", env={"DUPLEX_PLUGIN_OPTIONS": "=x"})
    assert result.returncode == 2
    assert "DUPLEX_PLUGIN_OPTIONS: '=x' is not KEY=VALUE" in result.stderr
