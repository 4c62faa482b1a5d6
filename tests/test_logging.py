"""How loud the log is (issue 26): `--log-level` (before or after the command) and
DUPLEX_LOG_LEVEL set it, INFO by default; routine periodic work (the janitor's ticks) logs at
DEBUG only, so an idle `duplex serve` says nothing at INFO after it has started."""

import logging
import re
import time

import pytest

from harness.processes import start_serve
from services.cli import EXIT_NOT_AVAILABLE, main
from shared.settings import LogLevelError, log_level_from_env


@pytest.mark.parametrize(
    "value, level",
    [
        (None, "INFO"),
        ("", "INFO"),
        ("debug", "DEBUG"),
        (" Warning ", "WARNING"),
        ("ERROR", "ERROR"),
    ],
)
def test_duplex_log_level_is_read_from_the_environment(value, level):
    env = {} if value is None else {"DUPLEX_LOG_LEVEL": value}
    assert log_level_from_env(env) == level


def test_a_log_level_that_names_no_level_is_refused_by_name():
    with pytest.raises(LogLevelError, match=r"DUPLEX_LOG_LEVEL: 'loud' is not one of debug"):
        log_level_from_env({"DUPLEX_LOG_LEVEL": "loud"})


@pytest.fixture
def root_level(monkeypatch):
    """The root logger's level after `main` configured it (restored afterwards); `main` runs
    `duplex workers`, which stops at once without DUPLEX_REDIS_URL."""
    for name in ("DUPLEX_REDIS_URL", "DUPLEX_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger()
    saved = root.level

    def configured(argv: list[str]) -> str:
        assert main(argv) == EXIT_NOT_AVAILABLE
        return logging.getLevelName(root.level)

    yield configured
    root.setLevel(saved)


@pytest.mark.parametrize(
    "argv, env, level",
    [
        (["workers"], None, "INFO"),
        (["--log-level", "debug", "workers"], None, "DEBUG"),
        (["workers", "--log-level", "Warning"], None, "WARNING"),  # make serve ARGS="..."
        (["--log-level", "debug", "workers", "--log-level", "error"], None, "ERROR"),
        (["workers"], "debug", "DEBUG"),
        (["workers", "--log-level", "warning"], "debug", "WARNING"),  # the flag goes over
    ],
)
def test_the_flag_before_or_after_the_command_then_the_environment(
    root_level, monkeypatch, argv, env, level
):
    if env is not None:
        monkeypatch.setenv("DUPLEX_LOG_LEVEL", env)
    assert root_level(argv) == level


def test_a_bad_level_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("DUPLEX_LOG_LEVEL", "loud")
    assert main(["workers"]) == 2
    assert "DUPLEX_LOG_LEVEL: 'loud' is not one of debug, info, warning, error" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--log-level", "verbose"])
    assert exited.value.code == 2
    assert "'verbose' is not one of" in capsys.readouterr().err


#: arq's line for one run of the dead-worker sweep: "  0.00s ← duplex:sweep_dead_workers ● []"
#: (the job is named with the key prefix: services/api/janitor.py)
#: (at any level: a tick logged at INFO is counted, then fails the test below)
SWEEP_DONE = re.compile(r" [A-Z]+ arq\.worker: .*← [\w-]+:sweep_dead_workers ")
LEVEL = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def lines_at(logs: str, level: str) -> list[str]:
    return [line for line in logs.splitlines() if (m := LEVEL.match(line)) and m[1] == level]


def wait_for_ticks(process, ticks: int, timeout_s: float = 60) -> str:
    """The process's log once the janitor has finished `ticks` dead-worker sweeps."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = process.logs()
        if len(SWEEP_DONE.findall(logs)) >= ticks:
            return logs
        assert process.process.poll() is None, logs
        time.sleep(0.1)
    raise AssertionError(f"fewer than {ticks} janitor ticks logged:\n{process.logs()}")


@pytest.mark.parametrize(
    "args, env",
    [((), {"DUPLEX_LOG_LEVEL": "debug"}), (("--log-level", "debug"), {})],
    ids=["DUPLEX_LOG_LEVEL", "--log-level"],
)
def test_an_idle_serve_logs_its_ticks_at_debug_and_nothing_at_info(args, env):
    """The janitor's three jobs run every second; arq logged each run at INFO, 6 lines a
    second on an idle server. At DEBUG they show (the level is honoured), as DEBUG; between
    the 2nd and the 5th tick not one line at INFO or above is added."""
    process = start_serve("serve-log-level", args, **env)
    try:
        process.wait_ready()
        early = wait_for_ticks(process, 2)
        late = wait_for_ticks(process, 5)
    finally:
        process.stop()
    assert "log level DEBUG" in early  # the banner says how loud it is and how to change it
    assert not [line for line in late.splitlines() if " INFO arq." in line]
    assert len(SWEEP_DONE.findall("\n".join(lines_at(late, "DEBUG")))) >= 5
    assert lines_at(late, "INFO") == lines_at(early, "INFO")  # the start lines only
    assert len(lines_at(late, "DEBUG")) > len(lines_at(early, "DEBUG"))


def test_a_serve_on_a_real_redis_stops_without_a_traceback_and_deregisters(redis_server):
    """arq's close() disconnected the pod's own connection pool, which it had been given:
    every stop of `DUPLEX_REDIS_URL=... duplex serve` logged the live hub's failure with a
    traceback, and the pod's registration stayed behind for the next one to sweep as dead."""
    import redis

    prefix = "logstop"
    process = start_serve(
        "serve-real-redis", DUPLEX_REDIS_URL=redis_server.url, DUPLEX_KEY_PREFIX=prefix
    )
    try:
        process.wait_ready()
        client = redis.Redis.from_url(redis_server.url)
        assert client.zcard(f"{prefix}:apis") == 1
    finally:
        assert process.stop() == 0
    logs = process.logs()
    assert "Traceback" not in logs and "failed; restarting" not in logs, logs
    assert client.zcard(f"{prefix}:apis") == 0  # it deregistered on its way out
