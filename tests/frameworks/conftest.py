"""The voice-agent frameworks as clients of `duplex serve` (`make test-frameworks`).

Each framework runs in its own interpreter (the venv `make test-frameworks` builds from
tests/frameworks/requirements/): this side starts `duplex serve --plugin assistant`, says the
phrases with espeak-ng into WAV files, runs a client program (tests/frameworks/clients/) with
the framework's python and reads the one JSON line it prints.

Not collected by a plain `pytest` or `make test` (pyproject's `norecursedirs`): name the
directory, as `make test-frameworks` does.
"""

from __future__ import annotations

import os
import wave
from pathlib import Path

import pytest

from harness.client_programs import ClientRun, run_client_program
from harness.processes import start_serve
from harness.speech import spoken
from shared.protocol.duplex import float_to_pcm16

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).resolve().parent / "clients"
#: the venv `make test-frameworks` builds; FRAMEWORKS_PYTHON(_<FRAMEWORK>) override it
DEFAULT_PYTHON = ROOT / ".venv-frameworks" / "bin" / "python"

#: what the scenarios say, by the name the clients use
PHRASES = {
    "hello": "hello",  # "Hello! How can I help you?"
    # a reply of about 5 s, so that the interruption lands while the server still sends it
    # even on a loaded machine (a reply of 2.5 s once finished first under a parallel CI);
    # no pause in it longer than 110 ms, which Pipecat's local VAD would take for an end
    "long": (
        "repeat after me the cat sleeps under the warm kitchen table and the dog runs "
        "across the green garden"
    ),
    "thanks": "thank you",  # "You are welcome."
    # names the tool get_weather; Whisper hears this one whatever silence surrounds it
    # (24 of 24 offsets), "please get the weather" once became "please get to the wearer"
    "weather": "can you get the weather for me",
}

#: how long one client program may run (its steps time out well before)
CLIENT_TIMEOUT_S = 240


def framework_python(framework: str) -> str:
    """The interpreter of `framework`'s venv, or a skip saying how to get one."""
    python = (
        os.environ.get(f"FRAMEWORKS_PYTHON_{framework.upper()}")
        or os.environ.get("FRAMEWORKS_PYTHON")
        or str(DEFAULT_PYTHON)
    )
    if not Path(python).exists():
        pytest.skip(f"no {framework} venv at {python}: run `make test-frameworks`")
    return python


class RunningServer:
    """A server someone else started (FRAMEWORKS_SERVER_URL): its log is not ours to read."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")

    def logs(self) -> str:
        return ""


@pytest.fixture(scope="session")
def assistant_serve():
    """`duplex serve` with the assistant: speech in, a spoken answer out, barge-in, tools.
    FRAMEWORKS_SERVER_URL=http://HOST:PORT points the tests at a server already running
    the assistant instead."""
    if url := os.environ.get("FRAMEWORKS_SERVER_URL"):
        yield RunningServer(url)
        return
    process = start_serve("serve-frameworks", ("--plugin", "assistant"))
    try:
        process.wait_ready(timeout=180)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def speech_files(tmp_path_factory) -> dict[str, Path]:
    """Each phrase said by espeak-ng, as a 16 kHz mono pcm16 WAV (the clients resample)."""
    folder = tmp_path_factory.mktemp("speech")
    files = {}
    for name, text in PHRASES.items():
        path = folder / f"{name}.wav"
        with wave.open(str(path), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(16000)
            wav.writeframes(float_to_pcm16(spoken(text)))
        files[name] = path
    return files


@pytest.fixture
def run_client(assistant_serve, speech_files):
    """`run_client(framework, scenario)`: run that framework's client against the server."""

    def run(framework: str, scenario: str, model: str = "assistant") -> ClientRun:
        python = framework_python(framework)
        command = [
            python,
            str(CLIENTS / f"{framework}_client.py"),
            "--url",
            assistant_serve.base,
            "--model",
            model,
            "--scenario",
            scenario,
        ]
        for name, path in speech_files.items():
            command += ["--speech", f"{name}={path}"]
        return run_client_program(
            command,
            server=assistant_serve,
            marker='{"framework"',
            label=f"{framework} {scenario}",
            timeout_s=CLIENT_TIMEOUT_S,
            cwd=CLIENTS,
            # no framework may reach a real provider: a key that is not one, no proxies
            env={"OPENAI_API_KEY": "unused", "NO_PROXY": "*"},
        )

    return run
