"""A model of 1 s units through the tick-batched stage (harness/unit_echo.py: MiniCPM-o's
clock, camera frames and sized records, none of its model), on a clock the tests move: it
steps once a second on whole units of its client's 100 ms chunks, a camera frame reaches
the step of its unit, one quiet unit ends a response, and a session restored onto another
slot from its sized history (a barge-in in it) goes on exactly as the original."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from harness.unit_echo import (
    INTERRUPTED,
    LOUD,
    MAX_RECORD_BYTES,
    RATE,
    RECORD_HEAD,
    UNIT_SAMPLES,
    UnitEchoFrameModel,
    unit_text,
)
from shared.contracts import DuplexFence, ModelHistory, StageOutput, split_records
from tests.worker.stages.test_tick_batched import Rig, open_with_history

CHUNK = RATE // 10  # the client's 100 ms appends
JPEG = b"\xff\xd8\xff\xe0" + b"camera" * 50


def speech(units: float, hz: float = 300.0) -> np.ndarray:
    t = np.arange(int(units * UNIT_SAMPLES)) / RATE
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def feed_chunks(rig: Rig, sid: str, audio: np.ndarray, images_at: dict[int, bytes] = {}) -> None:  # noqa: B006
    """`audio` in 100 ms appends; `images_at[k]`: an image sent with append k."""
    for k, start in enumerate(range(0, len(audio), CHUNK)):
        image = images_at.get(k)
        rig.port.feed(sid, audio[start : start + CHUNK], images=(image,) if image else ())


def spoken(rig: Rig, sid: str) -> list[StageOutput]:
    """The session's outputs but the "ready" of its slot (`open_with_history`'s sink)."""
    return [o for o in rig.outputs[sid] if o.kind != "ready"]


def sized_history() -> ModelHistory:
    return ModelHistory(MAX_RECORD_BYTES, sized=True)


@pytest.fixture
async def rig():
    made = Rig(model=UnitEchoFrameModel(2), listen_after_frames=1)
    yield made
    await made.port.shutdown()


async def test_it_steps_once_a_second_on_whole_units_of_100_ms_chunks(rig):
    history = sized_history()
    await open_with_history(rig, "a", history)
    assert rig.port.period_s == 1.0
    feed_chunks(rig, "a", speech(1))
    await rig.tick()  # unit 0, loud: it says nothing yet (it says a unit back a unit later)
    feed_chunks(rig, "a", speech(0.9))
    await rig.tick()  # 900 ms: not a whole unit: stepped on silence, and says unit 0 back
    assert rig.port.stats()["silence_frames"] == 1
    feed_chunks(rig, "a", speech(0.1))
    await rig.tick()  # the unit whole again: taken; it says the silent unit: quiet
    assert rig.step_times == [1.0, 2.0, 3.0]
    assert [o.kind for o in spoken(rig, "a")] == ["audio", "listen"]  # a quiet unit ends it
    said = spoken(rig, "a")[0]
    assert said.audio.size == UNIT_SAMPLES and said.sample_rate_hz == RATE
    assert np.allclose(said.audio, speech(1), atol=1 / 32768)  # unit 0, as pcm16
    records = split_records(history.data, MAX_RECORD_BYTES, sized=True)
    # sized records: a loud unit holds its pcm16, a silent one its head alone
    assert [len(r) for r in records] == [RECORD_HEAD.size + 2 * UNIT_SAMPLES, 2, 32002]
    assert [RECORD_HEAD.unpack_from(r)[0] & LOUD for r in records] == [LOUD, 0, LOUD]
    # unit 1's text names its memory: the CRC of the records so far
    assert said.text == unit_text(1, zlib.crc32(records[1], zlib.crc32(records[0])), [])


async def test_a_camera_frame_reaches_the_step_of_its_unit(rig):
    await open_with_history(rig, "a", sized_history())
    audio = speech(2)
    # one frame a second, sent with the 8th append of each unit, as a camera at 1 fps
    feed_chunks(rig, "a", audio, images_at={7: JPEG, 17: JPEG[:100]})
    await rig.tick(2)
    assert [step[0] for step in rig.model.seen] == [(JPEG,), (JPEG[:100],)]
    texts = [o.text for o in spoken(rig, "a") if o.kind == "audio"]
    assert texts[0].endswith(f"saw 1: {len(JPEG)}") and texts[1].endswith("saw 1: 100")


async def test_a_session_restored_onto_another_slot_goes_on_as_the_original(rig):
    """Session a speaks, is barged in on, and sees; its sized history restored as session
    b on the other slot (replayed in the tick's spare time) makes b the same model: fed
    the same units from then on, b says and records what a does, frame for frame."""
    history = sized_history()
    request = await open_with_history(rig, "a", history)
    feed_chunks(rig, "a", speech(3), images_at={3: JPEG})
    await rig.tick(2)  # unit 1 says unit 0 back: a response
    await rig.port.abort([request])  # barge-in: what it was about to say is dropped
    await rig.port.ensure(DuplexFence("a", 1, 0), "stage0")  # the runner's restamp
    await rig.tick()
    records = split_records(history.data, MAX_RECORD_BYTES, sized=True)
    assert [RECORD_HEAD.unpack_from(r)[0] & INTERRUPTED for r in records] == [0, 0, INTERRUPTED]
    assert rig.model.interrupts == [1, 0]
    restored = ModelHistory(MAX_RECORD_BYTES, bytes(history.data), sized=True)
    frames_a, mark_a = history.frames, len(spoken(rig, "a"))
    await open_with_history(rig, "b", restored)  # it replays in the wait for the next tick
    await rig.tick()  # both step a unit of silence: b's replay is done
    assert rig.port.restore_progress()[0].done and rig.model.replay_pending(1) == 0
    assert restored.frames == frames_a + 1 == history.frames
    tail = speech(3, hz=500)
    for sid in ("a", "b"):
        feed_chunks(rig, sid, tail, images_at={12: JPEG[:60]})
    await rig.tick(3)
    new_a = split_records(history.data, MAX_RECORD_BYTES, sized=True)[frames_a:]
    new_b = split_records(restored.data, MAX_RECORD_BYTES, sized=True)[restored.restored_frames :]
    assert new_a == new_b and len(new_a) == 4
    said_a = [(o.kind, o.text) for o in spoken(rig, "a")[mark_a:]]
    said_b = [(o.kind, o.text) for o in spoken(rig, "b")]
    assert said_b == said_a and any(text.endswith("saw 1: 60") for _, text in said_a)
    # the units and the memory (CRC) the texts name are the original's, not a fresh slot's
    assert said_a[-1][1].split()[0] == str(history.frames - 1)
