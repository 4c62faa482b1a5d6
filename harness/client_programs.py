"""Client programs run in another venv's python against a `duplex serve`, for the suites that
test other people's clients (tests/frameworks, tests/seed_client): the program says what
happened as one JSON line on stdout, which this reads back with the server's log of the run.

Only for use under pytest: a program that times out or prints no result line fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest


class Server(Protocol):
    """What a run needs of the server: its log so far ("" where it is not ours to read)."""

    def logs(self) -> str: ...


class ClientRun:
    """One client program's result: its JSON line, its stderr and the server's log during the
    run, for failure messages."""

    #: how much of the server's event trace (the result's "trace") `explain` prints
    trace_chars = 6000

    def __init__(self, result: dict[str, Any], stderr: str, server_log: str) -> None:
        self.result = result
        self.stderr = stderr
        self.server_log = server_log

    def __getitem__(self, key: str) -> Any:
        return self.result[key]

    def explain(self) -> str:
        """What to print when an assertion on this run fails."""
        result = {k: v for k, v in self.result.items() if k != "trace"}
        trace = " ".join(self.result.get("trace", []))[: self.trace_chars]
        return (
            f"\n--- result\n{json.dumps(result, indent=1)[:12000]}"
            f"\n--- server events in order\n{trace}"
            f"\n--- client stderr (tail)\n{self.stderr[-3000:]}"
            f"\n--- server log (tail)\n{self.server_log[-3000:]}"
        )


Run = TypeVar("Run", bound=ClientRun)


def run_client_program(
    command: Sequence[str],
    *,
    server: Server,
    marker: str,
    label: str,
    timeout_s: float,
    cwd: Path,
    env: Mapping[str, str],
    run_class: type[Run] = ClientRun,
) -> Run:
    """Run `command` (a client program and its arguments, under another venv's python) in
    `cwd`, with this environment less every DUPLEX_* variable plus `env`, for at most
    `timeout_s`; its result is the last stdout line that starts with `marker` (as
    '{"framework"'). A timeout or a missing line fails the test, named by `label`."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    environment.update(env)
    log_start = len(server.logs())
    try:
        done = subprocess.run(
            list(command),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=environment,
            cwd=cwd,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{label}: no result in {timeout_s}s\n{expired}")
    server_log = server.logs()[log_start:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(marker)]
    if not lines:
        pytest.fail(
            f"{label}: exit {done.returncode}, no result line\n"
            f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}"
        )
    return run_class(json.loads(lines[-1]), done.stderr, server_log)
