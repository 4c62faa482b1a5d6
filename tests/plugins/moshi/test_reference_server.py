"""Our `/api/chat` against kyutai's `moshi.server` 0.2.13, the reference it follows (issue 42):
both serve the same tiny random checkpoint (harness/tiny_moshi.py) with greedy decoding, and
the same raw client, following the protocol, tells what each sends it.

The reference runs from this venv through tests/plugins/moshi/reference_server.py (its one
change: no CUDA wait in its warm-up; the config its loader needs for the tiny checkpoint).
Ours is `duplex api` and `duplex worker --plugin moshi` on redis-server.

Three models: the tiny checkpoint as it is, which speaks (its text stream is words on most
frames); the same with its text head zeroed, which listens (greedy on equal logits: token 0,
the end of padding, every frame: no words, its audio still generated); and the same with a
text head that picks `<s>` or `</s>` every frame (the tokenizer's control pieces, which a
sampling model can draw).

Two conversations each, on each server:

- **paced**: the handshake, a pause (a muted microphone, 1 s), 15 frames at a microphone's
  pace, the pause again, 3 more frames, the close;
- **early**: 6 frames sent at once right after the upgrade, before reading anything (so
  before the handshake arrives on ours, which opens the model's slot first), 4 more paced,
  the close.

What is compared: the handshake first and once; one `0x01` message per client frame, each
decoding to 1920 samples, whether the model speaks or listens, less one for the model's
acoustic delay on both (moshi's `LMGen.step` returns nothing for the first step; the
reference's `skip_frames = 1` costs no message: it steps that first frame too and only
resets Mimi's encoder after it, as ours does); nothing in the pauses and nothing more than
that by the close (the counts at the close are exact: a server stepping on its own clock
would have sent more); text messages only after their step's audio, never empty, never a
NUL; the early frames answered. Counts and kinds, not the audio or the words themselves: the
reference runs the LM in bfloat16 (its default), ours in float32 on the CPU, so their greedy
tokens may part. The one difference, ours on purpose and asserted as such: moshi.server
sends every text token but 0 and 3 as text, `<s>` and `</s>` included; ours sends words
only (a client shows its user nothing the reference would not).

Waits are for what the socket shows (messages counted); the pauses are a microphone's
silence, during which nothing may come, and the exact counts at the close hold whatever
their length.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import sphn
from safetensors.torch import load_file, save_file
from websockets.asyncio.client import ClientConnection, connect

from harness.redis_server import free_port
from tests.e2e.waits import until
from tests.plugins.moshi.conftest import moshi_stack, user_audio
from tests.plugins.moshi.reference_server import reference_checkpoint

RATE = 24_000
FRAME = 1920  # 80 ms at 24 kHz: one model step
PACE_S = 0.08  # a microphone's pace
PAUSE_S = 1.0  # a muted microphone
WAIT_S = 60
#: the tiny LM's acoustic delay (harness/tiny_moshi.py: delays [0, 0, 1, 0, 1]): its first
#: step generates no audio, on both servers (moshi's LMGen returns None for it), as the 7B's
#: (delay 1 too: 99 messages for 100 frames)
DELAY = 1
SHIM = Path(__file__).with_name("reference_server.py")


# ------------------------------------------------------------------ the two models


def _text_head(tiny_dir: Path, rows: dict[int, float], name: str) -> Path:
    """The tiny LM's weights with its text head (`text_linear`, no bias) zeroed but for
    `rows`: token -> a weight on the head's input's first dimension."""
    state = load_file(tiny_dir / "model.safetensors")
    head = state["text_linear.weight"]
    head.zero_()
    for token, weight in rows.items():
        head[token, 0] = weight
    path = Path(tempfile.mkdtemp(prefix=f"{name}-moshi-")) / "model.safetensors"
    save_file(state, path)
    return path


#: the models (module doc): which text head each has
TEXT_HEADS: dict[str, dict[int, float] | None] = {
    "speaking": None,  # the tiny checkpoint's own
    # equal logits: greedy takes the first, token 0 (the end of padding), every frame
    "listening": {},
    # logits (0, -y, y, 0, ...): token 2 or 1 (`</s>` or `<s>`) as the sign of y, every frame
    "control": {1: -10.0, 2: 10.0},
}


@pytest.fixture(scope="module", params=list(TEXT_HEADS))
def model(request, tiny_dir: Path) -> Iterator[tuple[str, Path, Path]]:
    """(which, the checkpoint directory for ours, the LM weights for the reference)."""
    rows = TEXT_HEADS[request.param]
    if rows is None:
        yield request.param, tiny_dir, tiny_dir / "model.safetensors"
        return
    weights = _text_head(tiny_dir, rows, request.param)
    directory = Path(tempfile.mkdtemp(prefix=f"{request.param}-dir-"))
    for file in tiny_dir.iterdir():
        shutil.copy(file, directory / file.name)
    shutil.copy(weights, directory / "model.safetensors")
    yield request.param, directory, weights
    shutil.rmtree(directory, ignore_errors=True)
    shutil.rmtree(weights.parent, ignore_errors=True)


# ------------------------------------------------------------------ the two servers


def _wait_listening(process: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    """The reference accepts connections once its model is loaded and warmed up (it binds
    after): a TCP connect, polled; one that exits says why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moshi.server exited early:\n{log.read_text(errors='replace')}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moshi.server not ready after {timeout}s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def reference(model, tiny_dir: Path) -> Iterator[str]:
    """kyutai's moshi.server on the model (greedy): its /api/chat URL."""
    _, _, weights = model
    config_dir = Path(tempfile.mkdtemp(prefix="moshi-reference-"))
    arguments = reference_checkpoint(
        tiny_dir, config_dir, moshi_weight=weights, temp=0, temp_text=0
    )
    port = free_port()
    log = config_dir / "server.log"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, str(SHIM), "--host", "127.0.0.1", "--port", str(port), *arguments],
        env=environment,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_listening(process, port, log, 120)
        yield f"ws://127.0.0.1:{port}/api/chat"
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        shutil.rmtree(config_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ours(model, redis_server) -> Iterator[str]:
    """`duplex api` and `duplex worker --plugin moshi` on the model (greedy): the API pod's
    /api/chat URL."""
    _, directory, _ = model
    with moshi_stack(redis_server.url, directory, "reference") as (api, _, _):
        yield f"ws://127.0.0.1:{api.port}/api/chat"


# ------------------------------------------------------------------ the raw client


@dataclasses.dataclass
class Received:
    """What one conversation got, in order."""

    kinds: list[int] = dataclasses.field(default_factory=list)
    texts: list[bytes] = dataclasses.field(default_factory=list)
    samples: int = 0  # decoded from the 0x01 messages
    #: messages that came during each pause (a muted microphone)
    in_pauses: list[int] = dataclasses.field(default_factory=list)

    @property
    def audio(self) -> int:
        return self.kinds.count(1)


class RawClient:
    """Moshi's protocol by hand: `0x01` + Ogg Opus pages of one stream out (sphn's writer,
    an 80 ms frame a message), `0x00`/`0x01`/`0x02` in."""

    def __init__(self) -> None:
        self.writer = sphn.OpusStreamWriter(RATE)
        self.reader = sphn.OpusStreamReader(RATE)
        self.got = Received()
        self.sent = 0  # frames

    def encode(self, audio: np.ndarray) -> list[bytes]:
        """The messages for `audio` [frames, 1920], one a frame, next in the stream."""
        return [b"\x01" + self.writer.append_pcm(frame) for frame in audio]

    async def read(self, ws: ClientConnection) -> None:
        async for message in ws:
            assert isinstance(message, bytes), f"a text frame: {message!r}"
            self.got.kinds.append(message[0])
            if message[0] == 1:
                self.got.samples += self.reader.append_bytes(message[1:]).shape[-1]
            elif message[0] == 2:
                self.got.texts.append(message[1:])

    async def send(self, ws: ClientConnection, messages: list[bytes], paced: bool) -> None:
        for message in messages:
            await ws.send(message)
            self.sent += 1
            if paced:
                await asyncio.sleep(PACE_S)

    async def speak(self, ws: ClientConnection, seed: int, frames: int) -> None:
        """`frames` frames at a microphone's pace, then until each has its audio message
        (the model's delay aside)."""
        await self.send(ws, self.encode(user_audio(seed, frames)), paced=True)

        async def audio() -> int:
            return self.got.audio

        await until(audio, lambda n: n >= self.sent - DELAY, WAIT_S)

    async def pause(self) -> None:
        """A muted microphone: nothing may come meanwhile."""
        before = len(self.got.kinds)
        await asyncio.sleep(PAUSE_S)
        self.got.in_pauses.append(len(self.got.kinds) - before)


async def converse(url: str, early: bool) -> tuple[Received, int]:
    """One conversation (the module doc's paced or early one): what came, frames sent."""
    client = RawClient()
    # encoded beforehand, so that they go out within a millisecond of the upgrade (ours
    # sends its handshake some 50 ms later, the model's slot open; the reference at once)
    early_messages = client.encode(user_audio(3, 6)) if early else []
    async with connect(url, max_size=None, open_timeout=WAIT_S) as ws:
        await client.send(ws, early_messages, paced=False)  # nothing read before
        reading = asyncio.create_task(client.read(ws))
        try:

            async def kinds() -> int:
                return len(client.got.kinds)

            await until(kinds, lambda n: n >= 1, WAIT_S)  # the handshake (checked below)
            if early:
                await client.speak(ws, 4, 4)
            else:
                await client.pause()  # after the handshake, no input: nothing
                await client.speak(ws, 5, 15)
                await client.pause()  # the client stopped: nothing
                await client.speak(ws, 6, 3)
        finally:
            await ws.close()
            # every message the server sent before our close is read before the close ends
            async with asyncio.timeout(WAIT_S):
                await reading
    return client.got, client.sent


def check(got: Received, sent: int, server: str) -> None:
    """The points every conversation meets, on either server, whatever the model."""
    assert got.kinds[0] == 0, f"{server}: the first message is not the handshake"
    assert got.kinds.count(0) == 1, f"{server}: {got.kinds.count(0)} handshakes"
    assert set(got.kinds) <= {0, 1, 2}, f"{server}: unknown kinds {set(got.kinds)}"
    assert got.audio == sent - DELAY, f"{server}: {got.audio} audio messages for {sent} frames"
    assert got.samples == got.audio * FRAME, f"{server}: {got.samples} samples decoded"
    assert got.in_pauses == [0] * len(got.in_pauses), f"{server}: sent while muted"
    for text in got.texts:
        assert text and b"\x00" not in text, f"{server}: a text message {text!r}"
        text.decode()
    # a step's text (at most one message) comes right after its audio
    for at, kind in enumerate(got.kinds):
        assert kind != 2 or got.kinds[at - 1] == 1, f"{server}: text not after audio at {at}"


def figures(which: str, early: bool, server: str, got: Received, sent: int) -> str:
    texts = [t.decode() for t in got.texts]
    return (
        f"{which} {'early' if early else 'paced'} {server}: {sent} frames sent,"
        f" {got.audio} audio messages ({got.samples} samples), {len(got.texts)} text,"
        f" in pauses {got.in_pauses}, kinds {''.join(map(str, got.kinds))}, texts {texts[:10]}"
    )


@pytest.mark.parametrize("early", [False, True], ids=["paced", "early"])
async def test_the_same_messages_per_client_frame_as_moshi_server(model, reference, ours, early):
    which, _, _ = model
    theirs, their_sent = await converse(reference, early)
    mine, my_sent = await converse(ours, early)
    print(f"\n{figures(which, early, 'moshi.server', theirs, their_sent)}")
    print(figures(which, early, "ours", mine, my_sent))
    check(theirs, their_sent, "moshi.server")
    check(mine, my_sent, "ours")
    assert (mine.audio, mine.samples, mine.in_pauses) == (
        theirs.audio,
        theirs.samples,
        theirs.in_pauses,
    )
    if which == "speaking":
        assert theirs.texts and mine.texts, "the speaking model said no word"
    elif which == "listening":
        assert not theirs.texts and not mine.texts, "the listening model spoke"
    else:
        # the one difference, ours on purpose: moshi.server sends every text token but 0
        # and 3 as text, the tokenizer's control pieces included; ours sends words only
        assert theirs.texts and set(theirs.texts) <= {b"<s>", b"</s>"}
        assert not mine.texts, f"ours sent control pieces as text: {mine.texts!r}"
