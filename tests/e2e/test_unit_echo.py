"""A 1 s-unit model that sees, end to end with real processes (`duplex api` and two
`duplex worker --plugin harness.unit_echo:UnitEchoFramePlugin` on redis-server): a client
streams 100 ms appends in real time with a camera frame every second; the model says what
it saw, a frame it cannot take is refused with `invalid_video_frames` and the session goes
on, and a drain of its worker moves it with its sized model history: the new worker replays
it and counts on, the memory each unit's words name (a CRC of every record before) being
the CRC of the records in Redis. Every wait is for something the client, Redis or /metrics
shows."""

from __future__ import annotations

import asyncio
import base64
import signal
import zlib

import numpy as np
import orjson

from harness.recording_client import drain
from harness.unit_echo import MAX_RECORD_BYTES, RATE, UNIT_SAMPLES
from shared.contracts import SIZED_RECORDS, split_records
from shared.protocol.duplex import AppendAudio, float_to_pcm16
from tests.e2e.native_moves import NativeFleet, restored_frames
from tests.e2e.waits import until

PLUGIN = "harness.unit_echo:UnitEchoFramePlugin"
MODEL = "unit_echo"
JPEG = b"\xff\xd8\xff\xe0" + b"a camera frame" * 30


async def stream(fleet: NativeFleet) -> None:
    """Real-time microphone audio and a camera at 1 fps: 100 ms appends (the pacing is
    the microphone's, not an ordering of events), 2 s of speech then 1 s of quiet."""
    t = np.arange(3 * UNIT_SAMPLES) / RATE
    audio = np.where(t < 2, 0.3 * np.sin(2 * np.pi * 300 * t), 0.0).astype(np.float32)
    pcm, step = float_to_pcm16(audio), 2 * RATE // 10
    frame = base64.b64encode(JPEG).decode()
    while not fleet.stop.is_set():
        for k, start in enumerate(range(0, len(pcm), step)):
            if fleet.stop.is_set():
                return
            video = (frame,) if k % 10 == 5 else ()
            chunk = pcm[start : start + step]
            await fleet.client.send(
                AppendAudio(audio=chunk, format="pcm16", sample_rate_hz=RATE, video_frames=video)
            )
            await asyncio.sleep(0.1)


def said(fleet: NativeFleet) -> list[str]:
    """The model's words so far: one transcript delta per speaking unit."""
    return [
        f["delta"]
        for f in fleet.client.delivered
        if f.get("type") == "response.output_audio_transcript.delta"
    ]


async def records(fleet: NativeFleet, sid: str) -> list[bytes]:
    data = await fleet.redis.get(fleet.keys.model_history(sid)) or b""
    return split_records(data, MAX_RECORD_BYTES, sized=True)


def memory(records: list[bytes]) -> int:
    crc = 0
    for record in records:
        crc = zlib.crc32(record, crc)
    return crc


async def test_a_unit_model_sees_refuses_bad_video_and_moves_with_its_memory(redis_server):
    fleet = NativeFleet(redis_server.url, ["w-a", "w-b"], PLUGIN)
    try:
        fleet.api.wait_ready(timeout=60)
        await until(lambda: fleet.redis.zcard(fleet.keys.workers()), lambda n: n >= 2, 120)
        client = fleet.client
        await client.connect({"model": MODEL})
        capabilities = client.session["capabilities"]
        assert capabilities["chunk_period_ms"] == 1000
        assert capabilities["optional_input_modalities"] == ["video"]
        fleet.tasks += [asyncio.create_task(drain(client)), asyncio.create_task(stream(fleet))]
        sid = client.session_id
        await until(lambda: asyncio.sleep(0, said(fleet)), lambda s: any("saw 1:" in w for w in s))
        assert any(w.endswith(f"saw 1: {len(JPEG)}") for w in said(fleet))

        # a frame that is not an image: refused, with the append's event id; the stream goes on
        await client.send(
            AppendAudio(
                event_id="bad-video",
                audio=bytes(2 * RATE // 10),
                format="pcm16",
                sample_rate_hz=RATE,
                video_frames=(base64.b64encode(b"GIF89a" + bytes(16)).decode(),),
            )
        )
        errors = await until(
            lambda: asyncio.sleep(0, [f for f in client.delivered if f.get("type") == "error"]),
            bool,
        )
        assert [(e["error"]["code"], e["error"].get("event_id")) for e in errors] == [
            ("invalid_video_frames", "bad-video")
        ]
        meta = fleet.keys.session(sid)
        assert int(await fleet.redis.hget(meta, "model_record_bytes")) == SIZED_RECORDS
        await until(lambda: records(fleet, sid), lambda r: len(r) >= 4)

        # a drain: the session moves to the other worker with its history
        owner = (await fleet.owner(sid)).decode()
        other = next(name for name in fleet.workers if name != owner)
        fleet.workers[owner].process.send_signal(signal.SIGTERM)
        await until(lambda: fleet.owner(sid), lambda w: w == other.encode(), 40)
        port = fleet.ports[other]
        frames = int(
            await until(lambda: asyncio.to_thread(restored_frames, port, MODEL), lambda n: n >= 4)
        )
        report = await until(
            lambda: fleet.redis.hget(meta, "restore"),
            lambda data: data is not None and orjson.loads(data)["done"],
            20,
        )
        assert orjson.loads(report)["frames"] == frames
        before = len(said(fleet))
        # the new worker speaks of units past the ones it restored, with their memory
        words = await until(
            lambda: asyncio.sleep(0, said(fleet)[before:]),
            lambda s: any(int(w.split()[0]) > frames for w in s),
            30,
        )
        unit, crc = next(
            (int(w.split()[0]), w.split()[1]) for w in words if int(w.split()[0]) > frames
        )
        written = await until(lambda: records(fleet, sid), lambda r: len(r) > unit)
        assert f"{memory(written[: unit + 1]):08x}" == crc
        seqs = [f["server_event_seq"] for f in client.delivered if "server_event_seq" in f]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert client.ended is None
    finally:
        await fleet.close()
