"""The tick stage's jitter buffer (`SlotState.resume_at`): a client whose chunks are longer
than a frame (GPT-Live's 100 ms against Moshi's 80 ms frames) is heard without a frame of
silence in the middle of its audio, and without losing any of it.

The client's chunks arrive at their real pace on the test's clock (`ManualClock`), at
several phases against the ticks; every frame the model steps is recorded. Taken as they
come, a tick before a chunk finds too little for some phases, and the model hears a frame
of silence inside the user's speech (and the rest of it 80 ms later, for good).
"""

from __future__ import annotations

import numpy as np
import pytest

from harness.frame_models import FRAME_SAMPLES, RATE
from services.worker.stages.slots import RECENT_CHUNKS, SlotState, jitter_cap_samples
from tests.worker.stages.test_tick_batched import Rig

CHUNK_MS = 100
CHUNKS = 40  # 4 s of speech
#: the jitter buffer's cap at Moshi's 80 ms frames: 240 ms, 3 frames
JITTER_CAP = jitter_cap_samples(FRAME_SAMPLES, RATE)


def speech(samples: int) -> np.ndarray:
    """A tone that is never zero (so a frame of silence in it is unmistakable)."""
    t = np.arange(samples) / RATE
    return (0.3 + 0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


async def stepped_frames(chunk_ms: int, phase_ms: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Run `CHUNKS` chunks of `chunk_ms` arriving every `chunk_ms` from `phase_ms` after
    the first tick; returns the frames the model stepped for the slot, and the input."""
    rig = Rig(slots=1)
    stepped: list[np.ndarray] = []
    step = rig.model.step

    def recording(frames: np.ndarray, active: np.ndarray, images=None):
        if active[0]:
            stepped.append(frames[0].copy())
        return step(frames, active, images)

    rig.model.step = recording
    chunk = RATE * chunk_ms // 1000
    audio = speech(chunk * CHUNKS)
    await rig.open("a")
    start = await rig.clock.next_sleeper()
    arrivals = [start + (phase_ms + i * chunk_ms) / 1000 for i in range(CHUNKS)]
    sent = 0
    ticks = (phase_ms + CHUNKS * chunk_ms) // 80 + 2 * JITTER_CAP // FRAME_SAMPLES + 2
    try:
        for _ in range(ticks):
            due = await rig.clock.next_sleeper()
            while sent < CHUNKS and arrivals[sent] < due:
                await rig.clock.advance_to(arrivals[sent])
                rig.port.feed("a", audio[sent * chunk : (sent + 1) * chunk])
                sent += 1
            await rig.tick()
    finally:
        await rig.port.shutdown()
    return stepped, audio


def heard(stepped: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """The model's input from its first frame of speech to its last, and the silent
    frames inside that span."""
    loud = [i for i, frame in enumerate(stepped) if np.abs(frame).max() > 0]
    span = stepped[loud[0] : loud[-1] + 1]
    gaps = sum(1 for frame in span if not np.abs(frame).max() > 0)
    return np.concatenate(span), gaps


@pytest.mark.parametrize("phase_ms", [0, 10, 30, 50, 70, 95])
async def test_100_ms_chunks_against_80_ms_frames_are_heard_without_a_gap(phase_ms):
    stepped, audio = await stepped_frames(CHUNK_MS, phase_ms)
    said, gaps = heard(stepped)
    assert gaps == 0
    # every sample, in order, and nothing else: the last partial frame stays buffered
    whole = len(audio) // FRAME_SAMPLES * FRAME_SAMPLES
    assert np.array_equal(said, audio[:whole])


@pytest.mark.parametrize("phase_ms", [0, 30, 60])
async def test_frame_sized_chunks_are_taken_as_they_come(phase_ms):
    """A client that sends a frame or less at a time waits for nothing more (no extra
    latency for it): its first frame is stepped at the first tick after it arrives."""
    stepped, audio = await stepped_frames(80, phase_ms)
    said, gaps = heard(stepped)
    assert gaps == 0 and np.array_equal(said, audio)
    first = next(i for i, frame in enumerate(stepped) if np.abs(frame).max() > 0)
    assert first == 1  # the tick at 0 had nothing; the next one had the first chunk


def test_the_buffer_depth_follows_the_chunks_and_a_burst_is_capped():
    slot = SlotState(0, "a", FRAME_SAMPLES, 25 * FRAME_SAMPLES, JITTER_CAP)
    assert slot.resume_at == FRAME_SAMPLES  # nothing fed yet: one frame
    slot.feed(np.ones(FRAME_SAMPLES // 4, np.float32))
    assert slot.resume_at == FRAME_SAMPLES
    slot.feed(np.ones(2400, np.float32))  # 100 ms
    assert slot.resume_at == 2400 + FRAME_SAMPLES // 4
    slot.feed(np.ones(RATE * 2, np.float32))  # a 2 s burst
    assert slot.resume_at == JITTER_CAP == 3 * FRAME_SAMPLES
    for _ in range(RECENT_CHUNKS):  # frame-sized appends again: the burst is forgotten
        slot.feed(np.ones(FRAME_SAMPLES, np.float32))
    assert slot.resume_at == FRAME_SAMPLES
    small = SlotState(0, "b", FRAME_SAMPLES, 2600, JITTER_CAP)
    small.feed(np.ones(2400, np.float32))
    assert small.resume_at == 2600  # never deeper than the input bound


def test_a_dry_tick_waits_for_the_buffer_to_refill():
    slot = SlotState(0, "a", FRAME_SAMPLES, 25 * FRAME_SAMPLES, JITTER_CAP)
    into = np.zeros(FRAME_SAMPLES, np.float32)
    slot.feed(np.ones(2400, np.float32))  # 100 ms: under 125 ms, not yet
    assert not slot.take_frame(into)
    slot.feed(np.ones(2400, np.float32))  # 200 ms
    assert slot.take_frame(into) and slot.take_frame(into)  # 40 ms left
    assert not slot.take_frame(into) and not slot.flowing  # dry: refill to 125 ms first
    slot.feed(np.ones(2400, np.float32))  # 140 ms
    assert slot.take_frame(into)
