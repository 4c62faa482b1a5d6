"""OpenBMB's realtime SDK as a client of `duplex serve` (`make test-map-client`).

The client, `openbmb_realtime` (the `openbmb-realtime` 0.1.6 wheel, OpenBMB's SDK for
MiniCPM-o's MAP Realtime V1), runs unchanged from .venv-map, which `make test-map-client`
builds: the wheel checked against its SHA-256 and websockets, nothing else. This side starts
`duplex serve` with a frame model that sees (tests/e2e/map_models.py: the echo frame model,
which says back what it was told and which camera frame it got), runs clients/map_client.py
with that venv's python, one scenario a run, and reads the one JSON line it prints.

Not collected by a plain `pytest` or `make test` (pyproject's `norecursedirs`): name the
directory, as `make test-map-client` does.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

import harness.client_programs
from harness.client_programs import run_client_program
from harness.processes import start_serve

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).resolve().parent / "clients"
#: what `make test-map-client` builds; MAP_PYTHON overrides it
DEFAULT_PYTHON = ROOT / ".venv-map" / "bin" / "python"
PLUGIN = "tests.e2e.map_models:SeeingEchoFramePlugin"
MODEL = "frame_echo_seeing"
KEY = "k-map-sdk"
SLOTS = 2
#: how long one client program may run (its steps time out well before)
CLIENT_TIMEOUT_S = 150
STEP_TIMEOUT_S = 30


def map_python() -> str:
    """The SDK venv's python, or a skip."""
    python = os.environ.get("MAP_PYTHON") or str(DEFAULT_PYTHON)
    if not Path(python).exists():
        pytest.skip(f"no MAP SDK venv at {python}: run `make test-map-client`")
    return python


class ClientRun(harness.client_programs.ClientRun):
    """A map_client.py run: its facts by key, the step that failed."""

    def __getitem__(self, key: str) -> Any:
        return self.result["facts"][key]

    @property
    def failed_step(self) -> str | None:
        return self.result["failed_step"]


@pytest.fixture(scope="session")
def serve():
    process = start_serve(
        "serve-map-sdk",
        ("--plugin", PLUGIN, "--max-sessions", str(SLOTS)),
        DUPLEX_API_KEYS=KEY,
        DUPLEX_ADMISSION_WAIT_S="20",  # the queue scenario frees a slot well within it
        DUPLEX_HEARTBEAT_INTERVAL_S="0.2",
        PYTHONPATH=str(ROOT),  # the test model is in tests/, which is not installed
    )
    try:
        process.wait_ready(timeout=120)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def frame(tmp_path_factory) -> bytes:
    """A camera frame: a small JPEG."""
    pixels = np.random.default_rng(3).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=80)
    return out.getvalue()


@pytest.fixture(scope="session")
def runs() -> dict[str, ClientRun]:
    """Runs already made, by scenario: tests that judge one run share it."""
    return {}


@pytest.fixture
def run_client(serve, runs, frame, tmp_path_factory):
    """`run_client(scenario)`: that scenario's run of the SDK against the server."""

    def run(scenario: str) -> ClientRun:
        if scenario in runs:
            return runs[scenario]
        jpeg = tmp_path_factory.mktemp("frames") / "frame.jpg"
        jpeg.write_bytes(frame)
        command = [
            map_python(),
            str(CLIENTS / "map_client.py"),
            "--url",
            serve.base,
            "--key",
            KEY,
            "--model",
            MODEL,
            "--scenario",
            scenario,
            "--jpeg",
            str(jpeg),
            "--slots",
            str(SLOTS),
            "--step-timeout",
            str(STEP_TIMEOUT_S),
        ]
        runs[scenario] = run_client_program(
            command,
            server=serve,
            marker='{"map_client"',
            label=scenario,
            timeout_s=CLIENT_TIMEOUT_S,
            cwd=CLIENTS,
            env={"NO_PROXY": "*"},
            run_class=ClientRun,
        )
        return runs[scenario]

    return run
