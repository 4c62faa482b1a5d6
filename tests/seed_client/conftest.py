"""vLLM-Omni's reference client as a client of `duplex serve` (`make test-seed-client`).

The client, `vllm_omni.clients.duplex.DuplexClient`, runs unchanged from the vllm-omni 0.30.0
wheel: `make test-seed-client` extracts the wheel's `vllm_omni/clients/` package (standard
library, `pybase64` and `websockets`; no vLLM, no torch) into .venv-seed/client, with no
`vllm_omni/__init__.py`, and builds the small venv .venv-seed for it. This side starts
`duplex serve` (the echo model, which says back what it was told), runs
clients/seed_client.py with that venv's python and that directory on PYTHONPATH, one scenario a
run, and reads the one JSON line it prints. The audio is harness/data/speech_16k.wav: real
speech, which the server's VAD hears.

Not collected by a plain `pytest` or `make test` (pyproject's `norecursedirs`): name the
directory, as `make test-seed-client` does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import harness.client_programs
from harness.client_programs import run_client_program
from harness.processes import HttpProcess, start_serve

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).resolve().parent / "clients"
SPEECH = ROOT / "harness" / "data" / "speech_16k.wav"
#: what `make test-seed-client` builds; SEED_PYTHON and SEED_CLIENT_PATH override them
DEFAULT_PYTHON = ROOT / ".venv-seed" / "bin" / "python"
DEFAULT_CLIENT_PATH = ROOT / ".venv-seed" / "client"
#: how long one client program may run (its steps time out well before)
CLIENT_TIMEOUT_S = 150
STEP_TIMEOUT_S = 30

#: the servers the scenarios need, started when first asked for: `duplex serve` arguments and
#: environment. `admission` holds 2 sessions; `expiry` 1, and lets a dropped session go after
#: 1 s (its slot comes free when it expired); `default` has room for a failed test's leftovers.
SERVERS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default": (("--max-sessions", "16"), {}),
    "admission": (("--max-sessions", "2"), {}),
    "expiry": (("--max-sessions", "1"), {"DUPLEX_DISCONNECT_GRACE_S": "1"}),
}


def seed_client() -> tuple[str, str]:
    """The seed venv's python and the directory holding `vllm_omni/clients`, or a skip."""
    python = os.environ.get("SEED_PYTHON") or str(DEFAULT_PYTHON)
    client_path = os.environ.get("SEED_CLIENT_PATH") or str(DEFAULT_CLIENT_PATH)
    if not Path(python).exists():
        pytest.skip(f"no seed venv at {python}: run `make test-seed-client`")
    if not (Path(client_path) / "vllm_omni" / "clients" / "duplex.py").exists():
        pytest.skip(f"no vllm_omni/clients under {client_path}: run `make test-seed-client`")
    return python, client_path


class ClientRun(harness.client_programs.ClientRun):
    """A seed_client.py run: its facts by key, the step that failed, the error codes seen."""

    trace_chars = 8000

    def __getitem__(self, key: str) -> Any:
        return self.result["facts"][key]

    @property
    def failed_step(self) -> str | None:
        return self.result["failed_step"]

    def error_codes(self) -> list[str | None]:
        return [error.get("code") for error in self.result["errors"] if isinstance(error, dict)]


class Servers:
    """`duplex serve` processes by name (SERVERS), started on free ports when first needed."""

    def __init__(self) -> None:
        self.running: dict[str, HttpProcess] = {}

    def get(self, name: str) -> HttpProcess:
        if name not in self.running:
            args, env = SERVERS[name]
            process = start_serve(f"serve-seed-{name}", args, **env)
            self.running[name] = process
            process.wait_ready(timeout=120)
        return self.running[name]

    def stop(self) -> None:
        for process in self.running.values():
            process.stop()


@pytest.fixture(scope="session")
def servers():
    started = Servers()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def runs() -> dict[tuple[str, str], ClientRun]:
    """Runs already made, by (server, scenario): tests that judge one run share it."""
    return {}


@pytest.fixture
def run_client(servers, runs):
    """`run_client(scenario, server="default")`: that scenario's run against that server."""

    def run(scenario: str, server: str = "default") -> ClientRun:
        if (server, scenario) in runs:
            return runs[(server, scenario)]
        python, client_path = seed_client()
        serve = servers.get(server)
        command = [
            python,
            str(CLIENTS / "seed_client.py"),
            "--url",
            serve.base.replace("http://", "ws://"),
            "--scenario",
            scenario,
            "--speech",
            str(SPEECH),
            "--step-timeout",
            str(STEP_TIMEOUT_S),
        ]
        runs[(server, scenario)] = run_client_program(
            command,
            server=serve,
            marker='{"seed_client"',
            label=scenario,
            timeout_s=CLIENT_TIMEOUT_S,
            cwd=CLIENTS,
            env={"PYTHONPATH": client_path, "NO_PROXY": "*"},
            run_class=ClientRun,
        )
        return runs[(server, scenario)]

    return run
