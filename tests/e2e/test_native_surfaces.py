"""Moshi's protocol (`/api/chat`) and GPT-Live (`/v1/live/sessions`) end to end: real `duplex
api` and `duplex worker --plugin harness.frame_models:EchoFramePlugin` processes on
redis-server (one slot: the model serves one session at a time), real WebSocket clients.

The echo frame model says each frame back 2 frames later while it is loud, with "." as its
words. The clients stream at a microphone's pace (80 or 100 ms a message: pacing, not an
ordering of events); every wait is for something the socket or Redis shows.
"""

from __future__ import annotations

import asyncio
import base64
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import orjson
import pytest
import redis
import sphn
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from harness.frame_models import RATE, tone
from harness.processes import start_api, start_worker
from shared.protocol.duplex import MOSHI_AUDIO
from shared.redis.connection import connect as redis_connect
from shared.redis.keys import KeySchema
from shared.redis.live_message import journal_entry_records
from tests.e2e.waits import until

PLUGIN = "harness.frame_models:EchoFramePlugin"
CHECKOUT = str(Path(__file__).resolve().parents[2])
KEY = "k-native"
FRAME = 1920  # 80 ms at 24 kHz
FAST = {"DUPLEX_HEARTBEAT_INTERVAL_S": "0.2", "DUPLEX_HEARTBEAT_TTL_S": "2.0"}
WAIT_S = 30


@pytest.fixture(scope="module")
def native(redis_server):
    """One native worker of one slot, one cascade worker (model "echo"), one API pod with a
    key; a full server is refused after a 1 s wait."""
    prefix = f"duplex-native-{uuid.uuid4().hex[:8]}"
    worker = start_worker(
        redis_server.url,
        prefix,
        "native-worker",
        PLUGIN,
        PYTHONPATH=CHECKOUT,
        DUPLEX_MAX_SESSIONS="1",
        **FAST,
    )
    cascade = start_worker(redis_server.url, prefix, "cascade-worker", "echo", **FAST)
    api = start_api(
        redis_server.url,
        prefix,
        "native-api",
        DUPLEX_API_KEYS=KEY,
        DUPLEX_ADMISSION_WAIT_S="1",
        **FAST,
    )
    registry = redis.Redis.from_url(redis_server.url)
    try:
        api.wait_ready()
        # both registered (polled): a session without a model goes to the native one's
        deadline = time.monotonic() + 60
        while registry.zcard(KeySchema(prefix).workers()) < 2:
            assert time.monotonic() < deadline, "the workers did not register"
            time.sleep(0.05)
        yield api, KeySchema(prefix), redis_server.url
    finally:
        for process in (api, worker, cascade):
            process.stop()
        registry.close()


def ws_base(api) -> str:
    return "ws" + api.base[4:]


async def received(ws: ClientConnection) -> bytes | str:
    async with asyncio.timeout(WAIT_S):
        return await ws.recv()


def _async(read):
    """A plain reader as the awaitable `until` polls."""

    async def call():
        return read()

    return call


# ---------------------------------------------------------------- Moshi's protocol


class MoshiClient:
    """What LiveKit's PersonaPlex plugin does on the wire: Ogg Opus out, 0x01/0x02 in."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.writer = sphn.OpusStreamWriter(RATE)
        self.reader = sphn.OpusStreamReader(RATE)
        self.heard: list[np.ndarray] = []
        self.words: list[str] = []

    async def speak(self, audio: np.ndarray) -> None:
        for start in range(0, len(audio) - FRAME + 1, FRAME):
            await self.ws.send(b"\x01" + self.writer.append_pcm(audio[start : start + FRAME]))
            await asyncio.sleep(0.08)

    async def listen(self) -> None:
        async for message in self.ws:
            assert isinstance(message, bytes)
            if message[0] == 1:
                self.heard.append(self.reader.append_bytes(message[1:]))
            elif message[0] == 2:
                self.words.append(message[1:].decode())

    def loud(self) -> int:
        return sum(int(np.abs(frame).max() > 0.1) for frame in self.heard if frame.size)


async def test_moshi_handshake_then_the_model_speaks_back_and_a_dropped_socket_frees_the_slot(
    native,
):
    api, keys, redis_url = native
    url = f"{ws_base(api)}/key/{KEY}/api/chat?voice_prompt=NATF2.pt&text_prompt=Be+brief&seed=4"
    async with connect(url) as ws:
        assert await received(ws) == b"\x00"  # the slot is open and its prompt stepped
        client = MoshiClient(ws)
        listening = asyncio.create_task(client.listen())
        await client.speak(np.concatenate([tone(10), np.zeros(RATE // 2, np.float32)]))
        await until(_async(client.loud), lambda n: n >= 8, WAIT_S)
        assert set(client.words) == {"."}
        listening.cancel()
    # no resume on this protocol: the session ended with its socket, and the only slot is
    # free again for the next conversation (which the door waits for, as the reference
    # servers' lock makes a client wait)
    async with connect(f"{ws_base(api)}/api/chat?api_key={KEY}") as again:
        assert await received(again) == b"\x00"
    handle = redis_connect(redis_url)

    async def states() -> set[bytes]:
        sessions = [k async for k in handle.client.scan_iter(match=keys.session("*"))]
        return {await handle.client.hget(k, "state") for k in sessions if k.endswith(b"}")}

    try:  # both ended with their sockets (the second one's close is on its way)
        await until(states, lambda found: found == {b"closed"}, WAIT_S)
    finally:
        await handle.close()


async def test_moshi_the_clients_audio_is_the_clock_a_frame_out_for_every_frame_in(native):
    """As kyutai's moshi.server: the model steps once per 80 ms frame the client sent, and
    each step's audio goes back, the model's silence included; while the client sends
    nothing the model does not step (watched for a second of the worker's own clock, its
    heartbeats)."""
    api, keys, redis_url = native
    handle = redis_connect(redis_url)
    client = handle.client
    try:
        async with connect(f"{ws_base(api)}/api/chat?api_key={KEY}") as ws:
            assert await received(ws) == b"\x00"
            moshi = MoshiClient(ws)
            listening = asyncio.create_task(moshi.listen())
            sessions = [k async for k in client.scan_iter(match=keys.session("*"))]
            states = {k: await client.hget(k, "state") for k in sessions if k.endswith(b"}")}
            (key,) = [k for k, state in states.items() if state != b"closed"]
            events = keys.events(key.decode().split("{", 1)[1].removesuffix("}"))

            async def audio_records() -> int:
                entries = await client.xrange(events)
                records = [r for entry in entries for r in journal_entry_records(*entry)]
                return sum(1 for r in records if r.wire_type == MOSHI_AUDIO)

            async def a_second_of_the_worker() -> None:
                async def beat() -> float:
                    return await client.zscore(keys.workers(), "native-worker") or 0.0

                start = await beat()
                await until(beat, lambda at: at >= start + 1000, WAIT_S)

            await a_second_of_the_worker()  # after the handshake, no audio: no step
            assert await audio_records() == 0
            await moshi.speak(np.zeros(FRAME * 10, np.float32))  # the model listens
            await until(audio_records, lambda n: n >= 10, WAIT_S)
            await a_second_of_the_worker()
            assert await audio_records() == 10
            await moshi.speak(tone(5))  # the model speaks it back, 2 frames later
            await until(audio_records, lambda n: n >= 15, WAIT_S)
            await a_second_of_the_worker()
            assert await audio_records() == 15
            await until(_async(lambda: len(moshi.heard)), lambda n: n > 0, WAIT_S)
            listening.cancel()
    finally:
        await handle.close()


async def test_moshi_refusals_are_http_statuses_before_the_upgrade(native):
    api, _, _ = native
    base = ws_base(api)
    refused = {
        f"{base}/api/chat": 401,  # no key
        f"{base}/key/wrong/api/chat": 401,
        f"{base}/key/{KEY}/api/chat?seed=soon": 400,
        f"{base}/key/{KEY}/api/chat?model=echo": 400,  # a cascade model: not native
        f"{base}/key/{KEY}/api/chat?model=nothing": 400,  # not served
    }
    for url, status in refused.items():
        with pytest.raises(InvalidStatus) as info:
            async with connect(url):
                pass
        assert info.value.response.status_code == status, url
        body = orjson.loads(info.value.response.body)
        assert body["error"]["code"] and body["error"]["message"], url
    # the one slot held: the next upgrade waits DUPLEX_ADMISSION_WAIT_S, then 429
    async with connect(f"{base}/key/{KEY}/api/chat") as holder:
        assert await received(holder) == b"\x00"
        with pytest.raises(InvalidStatus) as full:
            async with connect(f"{base}/key/{KEY}/api/chat"):
                pass
        assert full.value.response.status_code == 429
        assert orjson.loads(full.value.response.body)["error"]["code"] == "resource_exhausted"


@pytest.mark.parametrize(
    ("message", "code"),
    [(b"\x01RIFF" + bytes(60), 1007), ("a text frame", 1003)],
)
async def test_moshi_input_that_is_not_ogg_opus_closes_the_socket_clearly(native, message, code):
    api, _, _ = native
    async with connect(f"{ws_base(api)}/key/{KEY}/api/chat") as ws:
        assert await received(ws) == b"\x00"
        await ws.send(message)
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(WAIT_S):  # until the close
                while True:
                    await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == code


# ---------------------------------------------------------------- GPT-Live


class LiveClient:
    """GPT-Live's JSON events, as LiveKit's GPTLiveModel sends them: 100 ms appends."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.events: list[dict] = []

    async def send(self, event: dict) -> None:
        await self.ws.send(orjson.dumps(event).decode())

    async def next(self, wire_type: str) -> dict:
        while True:
            event = orjson.loads(await received(self.ws))
            self.events.append(event)
            if event["type"] == wire_type:
                return event

    async def speak(self, audio: np.ndarray) -> None:
        pcm = (audio * 32767).astype("<i2").tobytes()
        step = RATE // 10 * 2
        for start in range(0, len(pcm), step):
            chunk = base64.b64encode(pcm[start : start + step]).decode()
            await self.send({"type": "session.input_audio.append", "audio": chunk})
            await asyncio.sleep(0.1)

    def count(self, wire_type: str) -> int:
        return sum(1 for e in self.events if e["type"] == wire_type)


def live_url(api) -> str:
    return f"{ws_base(api)}/v1/live/sessions"


async def start(client: LiveClient, **session) -> dict:
    await client.send({"type": "session.start", "session": {"model": "frame_echo", **session}})
    return await client.next("session.started")


async def test_a_gpt_live_session_hears_speaks_mutes_and_closes_with_its_usage(native):
    api, _, _ = native
    headers = {"Authorization": f"Bearer {KEY}"}
    async with connect(live_url(api), additional_headers=headers) as ws:
        client = LiveClient(ws)
        started = await start(
            client,
            instructions="Be brief.",
            audio={"format": {"type": "audio/pcm", "rate": 24000}, "output": {"voice": "marin"}},
            delegation={"type": "responses", "responses": {"model": "gpt-5.6-luna"}},
        )
        assert started["session"]["id"].startswith("duplex-")
        await client.speak(np.concatenate([tone(10), np.zeros(RATE // 2, np.float32)]))
        words = await client.next("session.output_transcript.delta")
        assert words["delta"] == "." and words["end_ms"] > words["start_ms"] >= 0
        assert client.count("session.output_audio.delta") >= 1

        await client.send({"type": "session.input_audio.mute", "event_id": "mute-1"})
        assert (await client.next("session.input_audio.muted"))["client_event_id"] == "mute-1"
        before = client.count("session.output_audio.delta")
        await client.speak(tone(10))  # heard as silence: nothing comes back
        await client.send({"type": "session.update", "session": {"delegation": {}}})
        await client.next("session.updated")
        assert client.count("session.output_audio.delta") == before

        for bad, code in [
            (
                {"type": "session.commentary.append", "content": "hi", "delegation_id": None},
                "native_text_append_unsupported",
            ),
            ({"type": "response.create"}, "unsupported_native_response_options"),
            ({"type": "session.start", "session": {"model": "frame_echo"}}, "session_exists"),
            ({"type": "session.input_audio.append", "audio": "not base64!"}, "bad_audio"),
            ({"type": "dance"}, "unknown_event"),
        ]:
            await client.send({**bad, "event_id": f"bad-{code}"})
            error = (await client.next("error"))["error"]
            assert (error["code"], error["client_event_id"]) == (code, f"bad-{code}")
        await ws.send("{not json")
        assert (await client.next("error"))["error"]["code"] == "invalid_json"

        await client.send({"type": "session.close"})
        closed = await client.next("session.closed")
        assert closed["reason"] == "close_requested"
        assert closed["usage"]["seconds"] >= 1.5  # the audio it took, muted included
        with pytest.raises(ConnectionClosed) as ended:
            await received(ws)
        assert ended.value.rcvd is not None and ended.value.rcvd.code == 1000


async def test_gpt_live_refusals(native):
    api, _, _ = native
    with pytest.raises(InvalidStatus) as unauthorized:
        async with connect(live_url(api)):
            pass
    assert unauthorized.value.response.status_code == 401
    headers = {"Authorization": f"Bearer {KEY}"}
    async with connect(live_url(api), additional_headers=headers) as ws:
        client = LiveClient(ws)
        await client.send({"type": "session.input_audio.append", "audio": ""})
        assert (await client.next("error"))["error"]["code"] == "invalid_session_config"
        await client.send(
            {
                "type": "session.start",
                "session": {"model": "frame_echo", "audio": {"format": {"type": "audio/opus"}}},
            }
        )
        assert (await client.next("error"))["error"]["code"] == "unsupported_audio_format"
        with pytest.raises(ConnectionClosed):
            await received(ws)  # a session.start that opens nothing ends the socket


# ---------------------------------------------------------------- a drain


@pytest.fixture
async def two_native_workers(redis_server):
    prefix = f"duplex-native-move-{uuid.uuid4().hex[:8]}"
    env = {"PYTHONPATH": CHECKOUT, **FAST}
    workers = [start_worker(redis_server.url, prefix, f"w-{i}", PLUGIN, **env) for i in range(2)]
    api = start_api(redis_server.url, prefix, "move-api", **FAST)
    handle = redis_connect(redis_server.url)
    try:
        api.wait_ready()
        yield api, KeySchema(prefix), handle.client, workers
    finally:
        api.stop()
        for worker in workers:
            worker.stop()
        await handle.close()


@pytest.mark.parametrize(
    ("how", "after_s"),
    [(signal.SIGTERM, 7.0), (signal.SIGKILL, 10.0)],
    ids=["drain", "failover"],
)
async def test_a_gpt_live_session_keeps_its_mute_and_usage_when_its_worker_goes(
    two_native_workers, how, after_s
):
    """SIGTERM: a drain moves the session at once, with a final checkpoint. SIGKILL: another
    worker restores it from its last checkpoint (written when the mute was acknowledged)."""
    api, keys, redis, workers = two_native_workers
    await until(lambda: redis.zcard(keys.workers()), lambda n: n >= 2, 60)
    async with connect(live_url(api)) as ws:
        client = LiveClient(ws)
        started = await start(client)
        sid = started["session"]["id"]
        await client.send({"type": "session.input_audio.mute", "event_id": "m"})
        await client.next("session.input_audio.muted")
        await client.speak(tone(70))  # 5.6 s: past the first usage report
        before = (await client.next("session.usage.updated"))["usage"]["seconds"]
        owner = (await redis.hget(keys.session(sid), "worker")).decode()
        drained = next(w for w in workers if w.name == owner)
        drained.process.send_signal(how)
        await until(
            lambda: redis.hget(keys.session(sid), "worker"), lambda w: w and w.decode() != owner
        )
        # more on the other worker: still muted there, and the usage goes on from where it
        # was (the audio of the move itself may be lost: a native session hears silence)
        await client.speak(tone(int(after_s * 12.5)))
        after = (await client.next("session.usage.updated"))["usage"]["seconds"]
        await client.send({"type": "session.close"})
        closed = await client.next("session.closed")
        assert client.count("session.output_audio.delta") == 0  # muted on both workers
        assert client.count("session.started") == 1  # the restored slot says nothing
        assert client.count("error") == 0
        assert 5 <= before < 10 <= after <= closed["usage"]["seconds"]
