"""MAP Realtime V1 (OpenBMB's realtime protocol for MiniCPM-o) on `duplex serve`, from the
socket: what the protocol suite (test_protocol_suite.py) does not cover of it.

A real `duplex serve` with a frame model that sees (tests/e2e/map_models.py: the echo frame
model that also says which image it got), 2 slots, a 5 s admission wait. Each test opens
raw sockets as OpenBMB's SDK does (`/v1/realtime?mode=...&model=...`, subprotocol
`map.realtime`, `Authorization: Bearer`) and checks: the queue before `session.init`
(`session.queued` while both slots are held, `session.queue_done` once one is freed, the
`error` that ends a wait past the admission wait), `session.init` mapped or refused,
MAP's `session.created` with its top-level `session_id`, float32 audio both ways, JPEG
frames reaching the model byte for byte in a video session, refusals the session outlives
said as `warning` (never `error`, which would end the SDK's session) with the session and
its neighbour going on, and `session.close` answered with `session.closed`. The SDK itself
runs against the same server in tests/map_client (`make test-map-client`).
"""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from PIL import Image
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from harness.frame_models import RATE, tone
from harness.processes import start_serve
from tests.e2e.map_models import seen
from tests.e2e.waits import until

CHECKOUT = str(Path(__file__).resolve().parents[2])
PLUGIN = "tests.e2e.map_models:SeeingEchoFramePlugin"
MODEL = "frame_echo_seeing"
KEY = "k-map"
WAIT_S = 30
ADMISSION_WAIT_S = 5
#: what the model is told: a second of tone, then half a second of quiet
UTTERANCE = np.concatenate([tone(12), np.zeros(RATE // 2, np.float32)])
CHUNK_S = 0.1


@pytest.fixture(scope="module")
def serve():
    process = start_serve(
        "serve-map",
        ("--plugin", PLUGIN, "--max-sessions", "2"),
        DUPLEX_API_KEYS=KEY,
        DUPLEX_ADMISSION_WAIT_S=str(ADMISSION_WAIT_S),
        DUPLEX_CONFIG_TIMEOUT_S="3",
        DUPLEX_HEARTBEAT_INTERVAL_S="0.2",
        PYTHONPATH=CHECKOUT,  # the test model is in tests/, which is not installed
    )
    try:
        process.wait_ready(timeout=120)
        yield process
    finally:
        process.stop()


def f32_16k(audio_24k: np.ndarray) -> bytes:
    """24 kHz samples as MAP's input: float32 at 16 kHz."""
    count = len(audio_24k) * 16_000 // RATE
    at_16k = np.interp(np.arange(count) * RATE / 16_000, np.arange(len(audio_24k)), audio_24k)
    return at_16k.astype("<f4").tobytes()


def jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=80)
    return out.getvalue()


class Map:
    """One MAP socket, its events read in a task of its own."""

    def __init__(self, serve, mode: str = "audio", model: str = MODEL) -> None:
        self.url = f"ws{serve.base[4:]}/v1/realtime?mode={mode}&model={model}"
        self.ws: ClientConnection | None = None
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        self.reader: asyncio.Task[None] | None = None
        self.session_id: str | None = None

    async def connect(self) -> Map:
        self.ws = await connect(
            self.url,
            additional_headers={"Authorization": f"Bearer {KEY}"},
            subprotocols=["map.realtime"],  # type: ignore[list-item]
        )
        self.reader = asyncio.create_task(self._read())
        return self

    async def open(self, payload: dict[str, Any] | None = None) -> Map:
        """Connect, `session.init` once told `session.queue_done`, until `session.created`."""
        await self.connect()
        await self.wait("session.queue_done")
        await self.send({"type": "session.init", "payload": payload or {}})
        created = await self.wait("session.created")
        self.session_id = created["session_id"]
        return self

    async def _read(self) -> None:
        assert self.ws is not None
        try:
            async for message in self.ws:
                self.events.append(orjson.loads(message))
                self.changed.set()
        except ConnectionClosed:
            pass
        self.changed.set()

    async def send(self, event: dict[str, Any] | str | bytes) -> None:
        assert self.ws is not None
        await self.ws.send(
            event if isinstance(event, str | bytes) else orjson.dumps(event).decode()
        )

    async def append(self, audio_24k: np.ndarray, **extra: Any) -> None:
        data = {"audio": base64.b64encode(f32_16k(audio_24k)).decode(), **extra}
        await self.send({"type": "input.append", "input": data})

    async def speak(self, audio: np.ndarray, frame: bytes | None = None) -> None:
        """The audio in 100 ms appends at a microphone's pace (each with `frame`)."""
        step = int(CHUNK_S * RATE)
        for start in range(0, len(audio) - step + 1, step):
            extra = {"video_frames": [base64.b64encode(frame).decode()]} if frame else {}
            await self.append(audio[start : start + step], **extra)
            await asyncio.sleep(CHUNK_S)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def closed(self) -> bool:
        return self.reader is not None and self.reader.done()

    async def wait(self, kind: str, count: int = 1) -> dict[str, Any]:
        async with asyncio.timeout(WAIT_S):
            while len(self.of(kind)) < count:
                assert not self.closed(), f"closed before {kind}: {self.types()}"
                self.changed.clear()
                await self.changed.wait()
        return self.of(kind)[count - 1]

    async def wait_closed(self) -> int | None:
        assert self.reader is not None and self.ws is not None
        async with asyncio.timeout(WAIT_S):
            await self.reader
        return self.ws.close_code

    def loud(self) -> int:
        """The model's audio: float32 at 24 kHz, its loud chunks counted."""
        chunks = [
            np.frombuffer(base64.b64decode(e["audio"]), "<f4")
            for e in self.of("response.output_audio.delta")
        ]
        return sum(1 for c in chunks if c.size and float(np.abs(c).max()) > 0.1)

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.reader is not None:
            self.reader.cancel()


async def speaks_back(client: Map, frame: bytes | None = None) -> None:
    heard = client.loud()
    await client.speak(UTTERANCE, frame)
    await until(_value(client.loud), lambda n: n > heard, WAIT_S)


def _value(read):
    async def call():
        return read()

    return call


async def test_a_session_opens_speaks_float32_and_closes(serve):
    ref = f32_16k(tone(12))  # a voice reference: 1 s of float32 at 16 kHz
    client = Map(serve)
    try:
        await client.open(
            {
                "system_prompt": "You are a helpful assistant.",
                "config": {
                    "temperature": 0.5,
                    "max_tokens": 20,
                    "length_penalty": 1.1,
                    "max_kv_tokens": 8000,
                    "tts_enabled": True,
                    "vision_hd": False,
                },
                "voice": {"ref_audio_base64": base64.b64encode(ref).decode()},
                "max_slice_nums": 1,
            }
        )
        assert client.ws is not None and client.ws.subprotocol == "map.realtime"
        assert client.types()[:2] == ["session.queue_done", "session.created"]  # a free slot
        created = client.of("session.created")[0]
        assert client.session_id is not None and client.session_id.startswith("duplex-")
        assert set(created) == {"type", "event_id", "session_id"}
        await speaks_back(client)
        await client.wait("response.done")
        words = client.of("response.output.delta")
        assert words and {(w["kind"], w["text"]) for w in words} == {("text", ".")}
        done = client.of("response.done")[0]["response"]
        assert done["status"] == "completed"
        audio = client.of("response.output_audio.delta")
        assert {a["response_id"] for a in audio} >= {done["id"]}
        # float32 at 24 kHz: the echo's 80 ms frames, 1920 samples of 4 bytes each
        assert all(len(base64.b64decode(a["audio"])) == 1920 * 4 for a in audio)
        assert not client.of("error") and not client.of("warning")
        await client.send({"type": "session.close", "reason": "user_stop"})
        closed = await client.wait("session.closed")
        assert closed["reason"] == "client_close"
        assert await client.wait_closed() == 1000
    finally:
        await client.close()


async def test_refusals_are_warnings_and_the_session_and_its_neighbour_go_on(serve):
    client, neighbour = Map(serve), Map(serve)
    try:
        await client.open()
        await neighbour.open()
        bad_audio = {"type": "input.append", "input": {"audio": "not base64!"}}
        five_bytes = base64.b64encode(b"\x00" * 5).decode()  # not whole float32 samples
        frame = base64.b64encode(jpeg(1)).decode()
        for message in (
            "{not json",
            b"\x01\x02",  # a binary frame
            {"type": "dance"},
            bad_audio,
            {"type": "input.append", "input": {"audio": five_bytes}},
            {"type": "input.append", "input": {"audio": ""}},
            {"type": "input.append"},
            {"type": "input.append", "input": {"audio": five_bytes[:4], "force_listen": "yes"}},
            {"type": "input.append", "input": {"audio": "AAAAAA==", "video_frames": [frame]}},
            {"type": "session.init", "payload": {}},
        ):
            await client.send(message)
        await client.wait("warning", 10)
        codes = [(w["warning"]["code"], w["warning"].get("param")) for w in client.of("warning")]
        assert codes == [
            ("invalid_json", None),
            ("bad_event", None),
            ("unknown_event", "type"),
            ("bad_audio", "input.audio"),
            ("bad_audio", "input.audio"),
            ("bad_audio", "input.audio"),
            ("bad_event", "input"),
            ("bad_event", "input.force_listen"),
            ("invalid_video_frames", "input.video_frames"),  # a mode=audio session
            ("session_exists", None),
        ]
        assert all(w["warning"]["message"] for w in client.of("warning"))
        assert not client.of("error")  # the SDK would have ended its session
        await speaks_back(client)
        await speaks_back(neighbour)
        assert not neighbour.of("warning") and not neighbour.of("error")
    finally:
        await client.close()
        await neighbour.close()


async def test_a_video_session_carries_its_jpeg_frames_to_the_model(serve):
    image = jpeg(7)
    client = Map(serve, mode="video")
    try:
        await client.open({"config": {"vision_hd": False}})
        await speaks_back(client, frame=image)
        said = await until(
            _value(lambda: [w["text"] for w in client.of("response.output.delta")]),
            lambda texts: seen(image) in texts,
            WAIT_S,
        )
        assert seen(image).startswith("<jpeg ")
        # every word is the echo's "." or what the model saw: that image, whole, each time
        assert all(text.replace(seen(image), "") in ("", ".") for text in said)
        assert not client.of("warning") and not client.of("error")
    finally:
        await client.close()


async def test_the_queue_until_a_slot_is_free_and_its_end_at_the_admission_wait(serve):
    holders = [await Map(serve).open(), await Map(serve).open()]  # both slots
    waiting = Map(serve)
    try:
        given_up = await Map(serve).connect()
        await given_up.wait("session.queued")
        error = (await given_up.wait("error"))["error"]
        assert error["code"] == "resource_exhausted"
        assert await given_up.wait_closed() == 1000
        assert "session.queue_done" not in given_up.types()

        await waiting.connect()
        await waiting.wait("session.queued")
        assert waiting.types()[0] == "session.queued"  # no session.init is asked for yet
        await holders[0].send({"type": "session.close"})
        await waiting.wait("session.queue_done")
        await waiting.send({"type": "session.init", "payload": {}})
        created = await waiting.wait("session.created")
        assert created["session_id"].startswith("duplex-")
        assert set(waiting.types()) <= {"session.queued", "session.queue_update"} | {
            "session.queue_done",
            "session.created",
        }
    finally:
        for client in (*holders, waiting):
            await client.close()


#: (the route's query, the session.init's payload or None for none sent, its refusal)
REFUSED_OPENS = {
    "temperature": (
        "mode=audio",
        {"config": {"temperature": 5}},
        ("invalid_session_config", "payload.config.temperature"),
    ),
    "unknown-key": (
        "mode=audio",
        {"config": {"top_p": 0.5}},
        ("invalid_session_config", "payload.config.top_p"),
    ),
    "ref-audio": (
        "mode=audio",
        {"voice": {"ref_audio_base64": "AAA"}},
        ("bad_audio", "payload.voice.ref_audio_base64"),
    ),
    "no-init": ("mode=audio", None, ("config_timeout", None)),
    # refused before session.queue_done: no session.init is asked for
    "mode": ("mode=radio", None, ("invalid_session_config", "mode")),
    "model": ("mode=audio&model=nobody", None, ("invalid_session_config", None)),
}


@pytest.mark.parametrize("case", sorted(REFUSED_OPENS))
async def test_an_open_that_cannot_be_is_an_error_and_the_end(serve, case):
    query, payload, refusal = REFUSED_OPENS[case]
    client = Map(serve)
    model = "" if "model=" in query else f"&model={MODEL}"
    client.url = f"{client.url.split('?')[0]}?{query}{model}"
    try:
        await client.connect()
        if payload is not None:
            await client.wait("session.queue_done")
            await client.send({"type": "session.init", "payload": payload})
        error = (await client.wait("error"))["error"]
        assert (error["code"], error.get("param")) == refusal
        assert error["message"]
        assert await client.wait_closed() == 1000
        assert "session.created" not in client.types()
        if case in ("mode", "model"):
            assert client.types() == ["error"]  # never queued for a slot it cannot have
    finally:
        await client.close()
