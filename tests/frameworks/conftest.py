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
import subprocess
import wave
from pathlib import Path

import pytest

from harness import processes
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
    # "You are welcome."; not "thank you" alone, which Pipecat's VAD (its defaults) misses
    # after 6 of the 48 silences pipecat_vad.py tries: Pipecat then never interrupts the reply
    "thanks": "thank you very much",
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


class NoServer:
    """What a program that talks to no server (pipecat_vad.py) has of one: no log to read."""

    def logs(self) -> str:
        return ""


@pytest.fixture
def pipecat_vad_sweep(speech_files):
    """`pipecat_vad_sweep()`: how Pipecat's own VAD hears each phrase its manual scenarios say,
    at every place the microphone can put it (clients/pipecat_vad.py)."""

    def run() -> ClientRun:
        command = [framework_python("pipecat"), str(CLIENTS / "pipecat_vad.py")]
        for name, path in speech_files.items():
            command += ["--speech", f"{name}={path}"]
        return run_client_program(
            command,
            server=NoServer(),
            marker='{"framework"',
            label="pipecat vad sweep",
            timeout_s=CLIENT_TIMEOUT_S,
            cwd=CLIENTS,
            env={},
        )

    return run


# ------------------------------------------------------------------ native (frame-clocked) models
# The native surfaces (test_native_clients.py): the Moshi binary protocol of /api/chat and
# OpenAI's GPT-Live protocol of /v1/live/sessions, each served for a frame-clocked plugin.

#: the venv of the Moshi plugin (`make .venv-moshi/.installed`); FRAMEWORKS_MOSHI_PYTHON overrides
DEFAULT_MOSHI_PYTHON = ROOT / ".venv-moshi" / "bin" / "python"
#: the one API key of the native servers: the clients connect with it
NATIVE_API_KEY = "frameworks-native-key"
#: the echo frame model (harness/frame_models.py), by its plugin path and its served name
ECHO_FRAME_PLUGIN = "harness.frame_models:EchoFramePlugin"
ECHO_FRAME_MODEL = "frame_echo"
#: greedy decoding on the CPU, one thread (as tests/plugins/moshi)
MOSHI_OPTIONS = ("device=cpu", "temperature=0", "temperature_text=0", "threads=1")

#: run with .venv-moshi's python: the tiny random checkpoint of harness/tiny_moshi.py with
#: PersonaPlex's token constants made for it (as tests/plugins/moshi/test_personaplex.py does),
#: and a voice prompt directory holding NATF2.pt, the voice LiveKit's PersonaPlex plugin asks for by
#: default: a `.pt` in NVIDIA's fork's layout (LM input embeddings and a token cache) that fits
#: the tiny LM; the plugin's own check of it runs here, so that a bad one fails the set-up
TINY_PERSONAPLEX = """
import asyncio, json, sys
from pathlib import Path
import torch
from harness.tiny_moshi import make_tiny_moshi
from plugins.moshi import MoshiPlugin
from shared.contracts import DuplexSessionConfig

root = Path(sys.argv[1])
checkpoint = make_tiny_moshi(
    root / "checkpoint", personaplex={"silence_tokens": [5, 6], "sine_tokens": [7, 8]}
)
config = json.loads((checkpoint / "config.json").read_text())
voices = root / "voices"
voices.mkdir()
frames, codebooks = 4, len(config["delays"])
generator = torch.Generator().manual_seed(7)
embeddings = 0.1 * torch.randn(frames, 1, 1, config["dim"], generator=generator)
cache = torch.zeros(1, codebooks, 4, dtype=torch.long)
cache[0, 0] = config["existing_text_padding_id"]
torch.save({"embeddings": embeddings, "cache": cache}, voices / "NATF2.pt")
plugin = MoshiPlugin.from_options(
    {"model_dir": str(checkpoint), "preset": "personaplex", "voice_prompt_dir": str(voices)}
)
asyncio.run(plugin.prepare_runtime_config(DuplexSessionConfig(voice="NATF2.pt")))
"""


def moshi_python() -> str:
    """The interpreter of .venv-moshi, or a skip saying how to get one."""
    python = os.environ.get("FRAMEWORKS_MOSHI_PYTHON") or str(DEFAULT_MOSHI_PYTHON)
    if not Path(python).exists():
        pytest.skip(
            f"no Moshi venv at {python}: the PersonaPlex server runs the moshi plugin there; "
            "run `make .venv-moshi/.installed` (or `make test-frameworks`, which builds it)"
        )
    return python


def make_in_moshi_venv(script: str, root: Path, what: str) -> None:
    """Run `script` (its one argument: `root`) with .venv-moshi's python, offline; a failure
    fails the set-up, naming `what` was not made."""
    made = subprocess.run(
        [moshi_python(), "-c", script, str(root)],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if made.returncode != 0:
        pytest.fail(f"{what} was not made:\n{made.stderr[-4000:]}")


@pytest.fixture(scope="session")
def tiny_personaplex(tmp_path_factory) -> dict[str, Path]:
    """The tiny PersonaPlex checkpoint and its voice prompt directory (made by .venv-moshi)."""
    root = tmp_path_factory.mktemp("tiny-personaplex")
    make_in_moshi_venv(TINY_PERSONAPLEX, root, "the tiny PersonaPlex checkpoint")
    return {"checkpoint": root / "checkpoint", "voices": root / "voices"}


def start_moshi_serve(name: str, checkpoint: Path, *plugin_options: str):
    """`duplex serve --plugin moshi` on `checkpoint` from .venv-moshi (torch and moshi live
    there), with `plugin_options` and MOSHI_OPTIONS, ONE session slot and an API key; ready."""
    duplex = Path(moshi_python()).with_name("duplex")
    options: list[str] = []
    for option in (*plugin_options, *MOSHI_OPTIONS):
        options += ["--plugin-option", option]
    args = ("--plugin", "moshi", "--model-dir", str(checkpoint), *options, "--max-sessions", "1")
    # harness.processes runs the `duplex` beside this interpreter: here, .venv-moshi's
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(processes, "DUPLEX", str(duplex))
        process = start_serve(name, args, DUPLEX_API_KEYS=NATIVE_API_KEY, HF_HUB_OFFLINE="1")
    try:
        process.wait_ready(timeout=180)
    except BaseException:
        process.stop()
        raise
    return process


@pytest.fixture(scope="session")
def personaplex_serve(tiny_personaplex):
    """`duplex serve --plugin moshi`, the PersonaPlex preset on the tiny checkpoint."""
    process = start_moshi_serve(
        "serve-personaplex",
        tiny_personaplex["checkpoint"],
        "preset=personaplex",
        f"voice_prompt_dir={tiny_personaplex['voices']}",
    )
    try:
        yield process
    finally:
        process.stop()


#: run with .venv-moshi's python: the tiny random Moshi checkpoint (no preset: Moshi itself)
TINY_MOSHI = """
import sys
from pathlib import Path
from harness.tiny_moshi import make_tiny_moshi

make_tiny_moshi(Path(sys.argv[1]) / "checkpoint")
"""


@pytest.fixture(scope="session")
def tiny_moshi(tmp_path_factory) -> Path:
    """The tiny random Moshi checkpoint (made by .venv-moshi)."""
    root = tmp_path_factory.mktemp("tiny-moshi")
    make_in_moshi_venv(TINY_MOSHI, root, "the tiny Moshi checkpoint")
    return root / "checkpoint"


@pytest.fixture(scope="session")
def moshi_serve(tiny_moshi):
    """`duplex serve --plugin moshi`: Moshi (no preset) on the tiny checkpoint."""
    process = start_moshi_serve("serve-moshi", tiny_moshi)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def echo_frame_serve():
    """`duplex serve` with the echo frame model (main venv), with an API key."""
    process = start_serve(
        "serve-echo-frame",
        ("--plugin", ECHO_FRAME_PLUGIN),
        DUPLEX_API_KEYS=NATIVE_API_KEY,
        PYTHONPATH=str(ROOT),  # the test model is in harness/, which is not installed
    )
    try:
        process.wait_ready(timeout=120)
        yield process
    finally:
        process.stop()


@pytest.fixture
def run_native_client():
    """`run_native_client(client, server, *args)`: run tests/frameworks/clients/<client>.py
    with the frameworks venv's python against `server`, with the native servers' API key."""

    def run(client: str, server, *args: str) -> ClientRun:
        python = framework_python("frameworks")
        command = [
            python,
            str(CLIENTS / f"{client}.py"),
            "--url",
            server.base,
            "--api-key",
            NATIVE_API_KEY,
            *args,
        ]
        return run_client_program(
            command,
            server=server,
            marker='{"framework"',
            label=client,
            timeout_s=CLIENT_TIMEOUT_S,
            cwd=CLIENTS,
            env={"OPENAI_API_KEY": "unused", "NO_PROXY": "*"},
        )

    return run
