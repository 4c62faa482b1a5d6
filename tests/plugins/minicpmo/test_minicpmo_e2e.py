"""The MiniCPM-o 4.5 plugin end to end: redis-server, `duplex api` and `duplex worker --plugin
minicpmo --model-dir DIR` as real processes of this venv (harness/processes.py runs the
`duplex` beside this interpreter), on the tiny random checkpoint our builder writes in the
official layout (conftest.py), greedy (`decode=greedy`) with the CPU's stand-in vocoder.

The tiny model hears a voice and answers it (harness/minicpmo_sounds.py: a broadband voice
makes it speak " there", the quiet after it ends its turn with " and"). Over the duplex
surface (`/v1/realtime?duplex=1`): 16 kHz audio streamed in at a microphone's pace, the
model's 24 kHz audio and its words back, one step a 1 s unit; camera frames (`video_frames`,
small JPEGs) reaching the model, which keeps them in the unit records it writes to Redis
(docs/redis-keys.md: the sized layout, plugins/minicpmo/records.py), and frames it cannot
take refused with `invalid_video_frames` while the session goes on; a barge-in that ends
the model's turn; tools refused; the official openai SDK on plain `/v1/realtime`; and a
session whose worker is drained or killed mid-conversation going on on the other worker
with its memory replayed from its records. Every wait is for an event the client, Redis or
/metrics shows; the model's clock is real time (one unit a second), so waits are generous.
"""

from __future__ import annotations

import asyncio
import base64
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from openai import AsyncOpenAI

from harness.minicpmo_sounds import BROKEN_JPEG, RATE, camera_frame, turns
from harness.processes import start_api, start_worker, wait_worker_ready
from harness.recording_client import RecordingClient, drain
from harness.redis_server import free_port
from plugins.minicpmo.frame_model import MAX_RECORD_BYTES
from plugins.minicpmo.records import TokenOrigin, UnitRecord
from plugins.minicpmo.vocabulary import Vocabulary
from shared.client.duplex_client import DuplexClientError
from shared.contracts import split_records
from shared.protocol.duplex import AppendAudio, float_to_pcm16
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from tests.e2e.native_moves import NativeFleet, restored_frames
from tests.e2e.waits import until

PLUGIN = "minicpmo"
MODEL = "minicpmo"
OPTIONS = "decode=greedy,threads=1"
#: the worker's environment: the checkpoint, greedy decoding, two slots
WORKER_ENV = {
    "DUPLEX_PLUGIN_OPTIONS": OPTIONS,
    "DUPLEX_MAX_SESSIONS": "2",
    "HF_HUB_OFFLINE": "1",
}
OUTPUT_RATE = 24_000
#: a 100 ms append of 16 kHz pcm16
APPEND_BYTES = 2 * RATE // 10
#: one wait for the model: a unit takes up to a second of CPU here, and a turn is 4 units
WAIT_S = 90


def model_env(checkpoint) -> dict[str, str]:
    return {"DUPLEX_MODEL_DIR": str(checkpoint), **WORKER_ENV}


@pytest.fixture(scope="module")
def cluster(redis_server, tiny_checkpoint):
    """One API pod and one MiniCPM-o worker (two slots) on redis-server."""
    prefix = f"duplex-minicpmo-{uuid.uuid4().hex[:8]}"
    health = free_port()
    worker = start_worker(
        redis_server.url,
        prefix,
        "minicpmo-worker",
        PLUGIN,
        DUPLEX_WORKER_HEALTH_PORT=str(health),
        **model_env(tiny_checkpoint),
    )
    api = start_api(redis_server.url, prefix, "minicpmo-api")
    try:
        wait_worker_ready(worker, health, 180)
        api.wait_ready()
        yield api, health, KeySchema(prefix)
    finally:
        api.stop()
        worker.stop()


@pytest.fixture
async def redis(redis_server):
    handle = connect(redis_server.url)
    try:
        yield handle.client
    finally:
        await handle.close()


class Microphone:
    """A client's microphone and camera: `audio` (16 kHz float32, looped) in 100 ms appends
    at a microphone's pace (the pacing is the microphone's, not an ordering of events), with
    one camera frame a second from `frames` (cycled) when given."""

    def __init__(
        self, client: RecordingClient, audio: np.ndarray, frames: tuple[bytes, ...] = ()
    ) -> None:
        self.client = client
        self.pcm = float_to_pcm16(audio)
        self.frames = [base64.b64encode(f).decode() for f in frames]
        self.stop = asyncio.Event()
        #: False: the camera pauses (the audio goes on)
        self.camera = True
        self.appends = 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self.stop.is_set():
            for start in range(0, len(self.pcm), APPEND_BYTES):
                if self.stop.is_set():
                    return
                video: tuple[str, ...] = ()
                if self.frames and self.camera and self.appends % 10 == 0:
                    video = (self.frames[(self.appends // 10) % len(self.frames)],)
                await self.client.send(
                    AppendAudio(
                        audio=self.pcm[start : start + APPEND_BYTES],
                        format="pcm16",
                        sample_rate_hz=RATE,
                        video_frames=video,
                    )
                )
                self.appends += 1
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(self.task, return_exceptions=True)


async def seen(client: RecordingClient, predicate: Callable[[list[dict]], Any], timeout=WAIT_S):
    """What `predicate` makes of the frames the client was delivered, once it is truthy."""
    return await until(lambda: asyncio.sleep(0, predicate(client.delivered)), bool, timeout)


def of_type(frames: list[dict], kind: str) -> list[dict]:
    return [f for f in frames if f.get("type") == kind]


def done_where(frames: list[dict], status: str) -> list[dict]:
    return [f for f in of_type(frames, "response.done") if f["response"]["status"] == status]


def transcript(client: RecordingClient, response_id: str) -> str:
    return "".join(
        f["delta"]
        for f in of_type(client.delivered, "response.output_audio_transcript.delta")
        if f.get("response_id") == response_id
    )


async def unit_records(redis: Any, keys: KeySchema, sid: str) -> list[UnitRecord]:
    """The session's model history in Redis, as the unit records the model wrote."""
    data = await redis.get(keys.model_history(sid)) or b""
    return [UnitRecord.decode(r) for r in split_records(data, MAX_RECORD_BYTES, sized=True)]


async def open_session(api, session: dict | None = None) -> RecordingClient:
    client = RecordingClient([api.base], heartbeat_s=None)
    await client.connect(session or {})
    return client


async def test_a_session_hears_speaks_and_a_barge_in_ends_the_models_turn(
    cluster, redis, tiny_checkpoint
):
    """The model answers a voice with its words and its 24 kHz voice, in a response it ends
    itself; a barge-in while it speaks cancels that response and reaches the model as a
    forced end of its turn (a record says so: `<|turn_eos|>`, then `<|listen|>`, both
    forced), with its memory: the history goes on from where it was, and the model answers
    the next turn."""
    api, health, keys = cluster
    special = Vocabulary(tiny_checkpoint).special
    client = await open_session(api)
    reading = asyncio.create_task(drain(client))
    microphone = Microphone(client, turns(4))
    sid = client.session_id
    try:
        capabilities = client.session["capabilities"]
        assert capabilities["implementation_level"] == "model_native_duplex"
        assert capabilities["chunk_period_ms"] == 1000
        assert capabilities["optional_input_modalities"] == ["video"]

        (done, *_) = await seen(client, lambda f: done_where(f, "completed"))
        rid = done["response"]["id"]
        assert "there" in transcript(client, rid)
        audio = b"".join(client.audio[rid])
        assert len(audio) >= 2 * OUTPUT_RATE  # at least a unit's second of 24 kHz pcm16
        assert np.abs(np.frombuffer(audio, "<i2")).max() > 0
        assert not (await unit_records(redis, keys, sid))[0].images  # no camera: audio only

        # the first unit of the model's next answer (it says three more): a barge-in
        before = len(client.delivered)
        spoke = await seen(client, lambda f: of_type(f[before:], "response.output_audio.delta"))
        talking = spoke[0]["response_id"]
        at_barge_in = await redis.get(keys.model_history(sid))
        await client.send({"type": "barge_in"})
        cut = await seen(
            client,
            lambda f: [d for d in of_type(f, "response.done") if d["response"]["id"] == talking],
        )
        assert cut[0]["response"]["status"] == "cancelled"
        forced = [TokenOrigin.FORCED, TokenOrigin.FORCED]
        records = await until(
            lambda: unit_records(redis, keys, sid),
            lambda rs: any(
                r.fed[:2] == (special.turn_eos, special.listen) and list(r.origins[:2]) == forced
                for r in rs
            ),
            WAIT_S,
        )
        # no amnesia: the model answers the next turn, its history grown from the same bytes
        after_cut = len(client.delivered)
        again = await seen(client, lambda f: done_where(f[after_cut:], "completed"))
        assert again[0]["response"]["id"] != talking
        history = await redis.get(keys.model_history(sid))
        assert history.startswith(at_barge_in) and len(history) > len(at_barge_in)
        assert len(records) > len(split_records(at_barge_in, MAX_RECORD_BYTES, sized=True))
        assert of_type(client.delivered, "error") == []
    finally:
        await microphone.close()
        await client.close()
        reading.cancel()
    metrics = httpx.get(f"http://127.0.0.1:{health}/metrics", timeout=5).text
    assert f'duplex_tick_duration_seconds_count{{model="{MODEL}"}}' in metrics


def refusals(client: RecordingClient) -> list[tuple[str, str | None, str | None]]:
    return [
        (e["error"]["code"], e["error"].get("event_id"), e["error"].get("param"))
        for e in of_type(client.delivered, "error")
    ]


async def test_camera_frames_reach_the_model_and_frames_it_cannot_take_are_refused(cluster, redis):
    """The model keeps every camera frame it saw in its unit's record (the images its
    vision encoder embedded: what a restore embeds again), byte for byte as the client sent
    it; a frame the worker or the model cannot take is refused with invalid_video_frames,
    naming the append, and the session goes on seeing and talking."""
    api, _, keys = cluster
    frames = tuple(camera_frame(seed) for seed in range(3))
    client = await open_session(api)
    reading = asyncio.create_task(drain(client))
    microphone = Microphone(client, turns(4), frames)
    sid = client.session_id
    try:
        records = await until(
            lambda: unit_records(redis, keys, sid),
            lambda rs: sum(len(r.images) for r in rs) >= 3,
            WAIT_S,
        )
        seen_images = [image for r in records for image in r.images]
        assert set(seen_images) <= set(frames)
        assert all(len(r.images) <= 1 for r in records)  # one camera frame a unit

        async def append(event_id: str, *video: bytes) -> None:
            await client.send(
                AppendAudio(
                    event_id=event_id,
                    audio=bytes(APPEND_BYTES),
                    format="pcm16",
                    sample_rate_hz=RATE,
                    video_frames=tuple(base64.b64encode(v).decode() for v in video),
                )
            )

        async def refused(count: int) -> list[dict]:
            return await seen(client, lambda f: len(of_type(f, "error")) >= count and f)

        # the worker's checks, at once, naming the append: not an image, two in one append
        await append("a-gif", b"GIF89a" + bytes(32))
        await append("two-frames", *frames[:2])
        await refused(2)
        assert refusals(client) == [
            ("invalid_video_frames", "a-gif", "video_frames[0]"),
            ("invalid_video_frames", "two-frames", "video_frames"),
        ]
        # the model's, at the unit it would have seen it: a file that starts as a JPEG and
        # is not one, a PNG under a patch on a side. The camera pauses (of the frames that
        # come with one unit the newest is kept: it would hide these), and each is awaited
        microphone.camera = False
        await append("broken-jpeg", BROKEN_JPEG)
        await refused(3)
        await append("tiny-png", camera_frame(9, 8, 8, "PNG"))
        await refused(4)
        microphone.camera = True
        model_refusals = of_type(client.delivered, "error")[2:]
        assert [e["error"]["code"] for e in model_refusals] == ["invalid_video_frames"] * 2
        assert "8x8" in model_refusals[1]["error"]["message"]

        # the session goes on: the model sees the next frames and answers the next turn
        count = len(records)
        after = len(client.delivered)
        await seen(client, lambda f: done_where(f[after:], "completed"))
        later = await until(
            lambda: unit_records(redis, keys, sid),
            lambda rs: any(r.images for r in rs[count + 1 :]),
            WAIT_S,
        )
        recorded = [image for r in later for image in r.images]
        assert set(recorded) <= set(frames)  # no refused frame was seen
        assert len(refusals(client)) == 4
    finally:
        await microphone.close()
        await client.close()
        reading.cancel()


async def test_what_minicpmo_does_not_take_is_refused(cluster):
    """Tools (its duplex mode makes no calls), turn-based sessions (the model decides when
    it speaks) and a change of the instructions it read first."""
    api, _, _ = cluster
    weather = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    for session, code in (
        ({"tools": [weather]}, "invalid_tools"),
        ({"extra_body": {"auto_response": False}}, "invalid_duplex_runtime_config"),
    ):
        client = RecordingClient([api.base], heartbeat_s=None)
        with pytest.raises(DuplexClientError) as refused:
            await client.connect(session)
        assert refused.value.code == code
    client = await open_session(api, {"instructions": "You are a helpful assistant."})
    try:
        await client.send({"type": "session.update", "session": {"instructions": "Other."}})
        error = (await client.until("error", timeout=WAIT_S))[-1]
        assert error.code == "instructions_update_unsupported"
        # the same instructions again are no change: accepted
        await client.send(
            {"type": "session.update", "session": {"instructions": "You are a helpful assistant."}}
        )
        await client.until("session.updated", timeout=WAIT_S)
    finally:
        await client.close()


async def test_the_openai_sdk_hears_the_model_on_plain_realtime(cluster):
    """The official openai SDK, GA Realtime on /v1/realtime (no duplex flag): 24 kHz pcm16
    in at a microphone's pace, the model's voice and words back in a response it ends."""
    api, _, _ = cluster
    openai_client = AsyncOpenAI(api_key="unused", base_url=f"{api.base}/v1")
    async with openai_client.realtime.connect(model=MODEL) as connection:
        await connection.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE}}},
            }
        )
        pcm = float_to_pcm16(turns(3, rate=OUTPUT_RATE))
        step = 2 * OUTPUT_RATE // 10

        async def say() -> None:
            for start in range(0, len(pcm), step):
                await connection.input_audio_buffer.append(
                    audio=base64.b64encode(pcm[start : start + step]).decode()
                )
                await asyncio.sleep(0.1)

        talking = asyncio.create_task(say())
        audio: dict[str, int] = {}
        try:
            deadline = time.monotonic() + WAIT_S
            async for event in connection:
                assert event.type != "error", event
                if event.type == "response.output_audio.delta":
                    audio[event.response_id] = audio.get(event.response_id, 0) + len(
                        base64.b64decode(event.delta)
                    )
                if event.type == "response.done" and event.response.status == "completed":
                    done = event.response
                    break
                assert time.monotonic() < deadline, "no response"
        finally:
            talking.cancel()
        (item,) = done.output
        assert "there" in "".join(c.transcript or "" for c in item.content)
        assert audio[done.id] >= 2 * OUTPUT_RATE  # a second of 24 kHz pcm16 at least


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["drain", "failover"])
async def test_a_session_keeps_its_memory_when_its_worker_goes(redis_server, tiny_checkpoint, how):
    """Two MiniCPM-o workers behind one API pod; a session talking and showing its camera
    is drained (SIGTERM: it moves at once) or its worker killed (SIGKILL: the other takes
    it from the last history written). The other worker replays the session's unit records
    (its audio heard again, its camera frames embedded again, every decision fed again:
    the restored-frames metric and the restore report count them) and goes on from there:
    it appends to the history it replayed, never rewriting it, sees the next frames and
    speaks; the client sees no error, and its events stay contiguous."""
    fleet = NativeFleet(redis_server.url, ["w-a", "w-b"], PLUGIN, **model_env(tiny_checkpoint))
    try:
        fleet.api.wait_ready(timeout=180)
        await until(lambda: fleet.redis.zcard(fleet.keys.workers()), lambda n: n >= 2, 180)
        client = fleet.client
        await client.connect({"model": MODEL})
        microphone = Microphone(client, turns(4), tuple(camera_frame(s) for s in range(3)))
        fleet.tasks += [asyncio.create_task(drain(client)), microphone.task]
        sid = client.session_id
        history = fleet.keys.model_history(sid)

        # the model has answered, and its history holds units that saw the camera
        await seen(client, lambda f: done_where(f, "completed"))
        await until(
            lambda: unit_records(fleet.redis, fleet.keys, sid),
            lambda rs: len(rs) >= 6 and any(r.images for r in rs),
            WAIT_S,
        )
        before = await fleet.redis.get(history)
        units_before = len(split_records(before, MAX_RECORD_BYTES, sized=True))

        owner = (await fleet.owner(sid)).decode()
        other = next(name for name in fleet.workers if name != owner)
        fleet.workers[owner].process.send_signal(how)
        await until(lambda: fleet.owner(sid), lambda w: w == other.encode(), WAIT_S)
        port = fleet.ports[other]
        restored = int(
            await until(
                lambda: asyncio.to_thread(restored_frames, port, MODEL),
                lambda n: n >= units_before,
                WAIT_S,
            )
        )
        report = await until(
            lambda: fleet.redis.hget(fleet.keys.session(sid), "restore"),
            lambda data: data is not None and orjson.loads(data)["done"],
            WAIT_S,
        )
        progress = orjson.loads(report)
        assert progress["frames"] == progress["replayed"] == restored
        print(f"\n{how.name}: {restored} units restored in {progress['seconds']} s")

        # the restored slot goes on: it speaks, sees, and writes past what it replayed
        since = len(client.delivered)
        await seen(client, lambda f: of_type(f[since:], "response.output_audio.delta"))
        written = await until(
            lambda: fleet.redis.get(history),
            lambda d: any(
                UnitRecord.decode(r).images
                for r in split_records(d, MAX_RECORD_BYTES, sized=True)[restored:]
            ),
            WAIT_S,
        )
        assert written[: len(before)] == before
        fleet.check_no_error_and_contiguous()
    finally:
        await fleet.close()
