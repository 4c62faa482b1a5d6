"""A model-native session of a 1 s-unit model that sees (harness/unit_echo.py), through the
SessionManager and its runner on a clock the tests move: camera frames sent with the duplex
surface's appends reach the model with their unit and it says what it saw; a bad frame is
refused with `invalid_video_frames` (by the worker, or by the model that cannot decode it)
and the session goes on; a barge-in interrupts its slot; and the session, moved to another
worker with its sized history, goes on with its memory."""

from __future__ import annotations

import base64
import zlib

import numpy as np
import pytest

from harness.unit_echo import (
    BROKEN,
    INTERRUPTED,
    RATE,
    RECORD_HEAD,
    UNIT_SAMPLES,
    UnitEchoFramePlugin,
)
from shared.contracts import SIZED_RECORDS, split_records
from shared.protocol.duplex import AppendAudio, BargeIn, float_to_pcm16
from tests.worker.engine.test_native_stream import Rig, restored, types

CHUNK = RATE // 10  # 100 ms appends
JPEG = b"\xff\xd8\xff\xe0" + b"camera" * 40


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def speech(units: float) -> np.ndarray:
    t = np.arange(int(units * UNIT_SAMPLES)) / RATE
    return (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)


async def say(rig: Rig, session, audio: np.ndarray, frames: dict[int, str] = {}) -> None:  # noqa: B006
    """`audio` in 100 ms appends (append k with the camera frame `frames[k]`), applied."""
    pcm = float_to_pcm16(audio)
    for k, start in enumerate(range(0, len(pcm), 2 * CHUNK)):
        video = (frames[k],) if k in frames else ()
        await session.send(
            AppendAudio(
                event_id=f"a{k}",
                audio=pcm[start : start + 2 * CHUNK],
                format="pcm16",
                sample_rate_hz=RATE,
                video_frames=video,
            )
        )
    await rig.settle(session)


def unit_rig() -> Rig:
    return Rig(plugin=UnitEchoFramePlugin(slots=2), max_sessions=2)


@pytest.fixture
async def rig():
    made = unit_rig()
    yield made
    await made.manager.shutdown()


async def test_camera_frames_reach_the_model_with_their_unit_and_it_says_what_it_saw(rig):
    session = await rig.open()
    capabilities = session.session["capabilities"]
    assert capabilities["chunk_period_ms"] == 1000 and capabilities["supports_image_input"]
    await say(rig, session, speech(2), frames={4: b64(JPEG)})  # in unit 0
    await rig.tick(2)
    slot = rig.port.slot_of(session.session_id)
    assert [step[slot] for step in rig.model.seen] == [(JPEG,), ()]
    events = await session.until("response.output_audio_transcript.delta")
    assert events[-1].delta.endswith(f"saw 1: {len(JPEG)}")
    assert types(events).count("response.created") == 1


async def test_bad_video_is_refused_and_the_session_goes_on(rig):
    session = await rig.open()
    # refused by the worker: not an image; the append is refused whole
    await say(rig, session, speech(0.1), frames={0: b64(b"GIF89a" + bytes(10))})
    error = (await session.until("error"))[-1]
    assert (error.code, error.param, error.related_event_id) == (
        "invalid_video_frames",
        "video_frames[0]",
        "a0",
    )
    # refused by the model: a JPEG it cannot decode; its unit goes on without it
    await say(rig, session, speech(1), frames={2: b64(JPEG + BROKEN)})
    await rig.tick()
    error = (await session.until("error"))[-1]
    assert error.code == "invalid_video_frames" and "could not be decoded" in error.message
    await say(rig, session, speech(1), frames={2: b64(JPEG)})
    await rig.tick()
    said = (await session.until("response.output_audio_transcript.delta"))[-1]
    assert said.delta.startswith("1 ") and said.delta.endswith(f"saw 1: {len(JPEG)}")
    assert rig.port.slot_of(session.session_id) is not None  # its slot steps on


async def test_a_barge_in_interrupts_the_slot_and_its_record_says_so(rig):
    session = await rig.open()
    await say(rig, session, speech(3))
    await rig.tick(2)  # unit 1 says unit 0 back
    await session.until("response.output_audio.delta")
    await session.send(BargeIn(event_id="b"))
    done = (await session.until("response.done"))[-1]
    assert done.response["status"] == "cancelled"
    await rig.settle(session)
    await rig.tick()
    slot = rig.port.slot_of(session.session_id)
    assert rig.model.interrupts[slot] == 1
    history = rig.manager.moves.model_history(session.session_id)
    records = split_records(history.data, history.record_bytes, sized=True)
    assert RECORD_HEAD.unpack_from(records[-1])[0] & INTERRUPTED


async def test_a_moved_session_goes_on_with_its_memory(rig):
    """Failed over with its checkpoint and sized history (`model_record_bytes` 0, as Redis
    says): the other worker replays it into a slot and the model counts on, its memory the
    original's (the units and CRC its words name)."""
    session = await rig.open()
    await say(rig, session, speech(2), frames={3: b64(JPEG)})
    await rig.tick(2)
    checkpoint = rig.manager.moves.snapshot(session.session_id)
    history = rig.manager.moves.model_history(session.session_id)
    assert history is not None and history.sized and history.meta_record_bytes == SIZED_RECORDS
    other = unit_rig()
    try:
        await other.manager.moves.restore(
            session.session_id,
            checkpoint,
            owner_generation=2,
            reason="worker_lost",
            model_history=bytes(history.data),
            model_record_bytes=history.meta_record_bytes,
        )
        runner = other.manager.table.runner(session.session_id)
        await runner.settle_input()
        await restored(other)
        pcm = float_to_pcm16(speech(2))
        for start in range(0, len(pcm), 2 * CHUNK):
            chunk = pcm[start : start + 2 * CHUNK]
            await other.manager.submit(
                session.session_id,
                AppendAudio(audio=chunk, format="pcm16", sample_rate_hz=RATE),
            )
        await runner.settle_input()
        await other.tick(2)
        await runner.settle_input()
        queue = other.router.queue(session.session_id)
        events = [queue.get_nowait() for _ in range(queue.qsize())]
        texts = [e.delta for e in events if e.wire_type == "response.output_audio_transcript.delta"]
        moved = other.manager.moves.model_history(session.session_id)
        assert moved.restored_frames == history.frames == 2 and moved.frames == 4
        # it says unit 2 back at unit 3, naming unit 3 and the CRC of all four records
        records = split_records(moved.data, moved.record_bytes, sized=True)
        assert records[:2] == split_records(history.data, history.record_bytes, sized=True)
        memory = 0
        for record in records:
            memory = zlib.crc32(record, memory)
        assert texts and texts[-1] == f"3 {memory:08x}"
    finally:
        await other.manager.shutdown()
