"""The tick-batched stage on a clock the tests move (`ManualClock`): one batched step per
frame for every open slot, silence for late input, deadline misses and the grid, slots
given and freed, turn taking, abort of one slot, and its metrics."""

from __future__ import annotations

import asyncio
import functools
import struct

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from harness.frame_models import (
    FRAME_SAMPLES,
    RATE,
    EchoFrameModel,
    EchoFramePlugin,
    ManualClock,
    tone,
)
from services.worker.stages.tick_batched import TickBatchedStagePort
from services.worker.stages.tick_clock import TickGrid
from services.worker.stages.tick_metrics import TickMetrics
from shared.contracts import (
    DuplexFence,
    DuplexSessionError,
    FrameClockedPlugin,
    FrameModel,
    FrameStepError,
    ModelHistory,
    StageOutput,
    StagePlan,
    frames_in,
)


class Rig:
    def __init__(self, slots: int = 4, model: FrameModel | None = None, **port_options) -> None:
        self.clock = ManualClock()
        self.model = model or EchoFrameModel(slots, delay_frames=2)
        self.registry = CollectorRegistry()
        self.port = TickBatchedStagePort(
            self.model,
            model_name="frame_echo",
            metrics=TickMetrics(self.registry),
            clock=self.clock,
            **{"listen_after_frames": 3, **port_options},
        )
        self.outputs: dict[str, list[StageOutput]] = {}
        #: the "ready" outputs each session got (kept apart: no response's)
        self.ready: dict[str, int] = {}
        self.step_times: list[float] = []
        self.model.on_step = lambda: self.step_times.append(self.clock.now())

    async def open(self, session_id: str, epoch: int = 0, client_clock: bool = False) -> str:
        fence = DuplexFence(session_id, epoch, 0)
        self.outputs[session_id] = []
        self.ready[session_id] = 0
        self.port.bind(session_id, functools.partial(self._sink, session_id))
        request_id = await self.port.ensure(fence, "stage0")
        plan = StagePlan(request_id, fence, "stage0", {"voice": "v"}, client_clock=client_clock)
        await self.port.submit_initial(plan)
        return request_id

    async def tick(self, count: int = 1) -> None:
        """Move time to each next tick and wait until it has run."""
        for _ in range(count):
            target = self.port.ticks + 1
            await self.clock.advance_to(await self.clock.next_sleeper())
            await asyncio.wait_for(self.port.wait_ticks(target), 5)

    def _sink(self, session_id: str, output: StageOutput) -> None:
        if output.kind == "ready":
            self.ready[session_id] += 1
        else:
            self.outputs[session_id].append(output)

    def kinds(self, session_id: str) -> list[str]:
        return [output.kind for output in self.outputs[session_id]]


@pytest.fixture
async def rig():
    made = Rig()
    yield made
    await made.port.shutdown()


async def test_one_batched_step_per_tick_serves_every_open_slot(rig):
    for sid in ("a", "b", "c"):
        await rig.open(sid)
    for _ in range(5):
        for sid in ("a", "b", "c"):
            rig.port.feed(sid, tone(1))
        await rig.tick()
    assert rig.model.batches == [3] * 5  # one step per tick, every session in it
    assert rig.model.steps == [5, 5, 5, 0]  # the free slot never advanced
    assert rig.port.stats()["silence_frames"] == 0
    # each session hears itself back after the model's 2-frame delay, as its own
    for sid in ("a", "b", "c"):
        assert rig.kinds(sid) == ["audio"] * 3
        assert {o.fence.session_id for o in rig.outputs[sid]} == {sid}


async def test_late_input_is_stepped_as_silence_and_the_grid_holds(rig):
    await rig.open("a")
    await rig.open("b")
    for _ in range(2):
        rig.port.feed("a", tone(1))
        rig.port.feed("b", tone(1))
        await rig.tick()
    for _ in range(3):  # b's client goes quiet on the wire: nothing arrives for it
        rig.port.feed("a", tone(1))
        await rig.tick()
    stats = rig.port.stats()
    assert stats["silence_frames"] == 3
    assert stats["silence_frames_by_session"] == {"a": 0, "b": 3}
    assert rig.model.batches == [2] * 5  # b is still stepped, on zeros
    assert rig.step_times == pytest.approx([0.08 * k for k in range(1, 6)])
    assert b'duplex_tick_silence_frames_total{model="frame_echo"} 3.0' in generate_latest(
        rig.registry
    )


async def test_a_partial_frame_waits_for_the_rest(rig):
    await rig.open("a")
    rig.port.feed("a", tone(1)[: FRAME_SAMPLES // 2])
    await rig.tick()
    assert rig.port.stats()["silence_frames"] == 1
    rig.port.feed("a", tone(1)[: FRAME_SAMPLES // 2])
    await rig.tick()
    assert rig.port.stats()["silence_frames"] == 1  # the two halves made one frame


async def test_a_step_past_its_deadline_is_counted_and_the_grid_resyncs(rig):
    await rig.open("a")
    await rig.tick(2)  # steps at 0.08, 0.16
    rig.model.on_step = lambda: (rig.step_times.append(rig.clock.now()), rig.clock.skew(0.2))
    await rig.tick()  # the step at 0.24 ends at 0.44, past its deadline 0.32
    rig.model.on_step = lambda: rig.step_times.append(rig.clock.now())
    await rig.tick(2)
    assert rig.port.stats()["deadline_misses"] == 1
    # no burst at 0.32 and 0.40: the next step is the first grid point after 0.44
    assert rig.step_times == pytest.approx([0.08, 0.16, 0.24, 0.48, 0.56])
    text = generate_latest(rig.registry).decode()
    assert 'duplex_tick_deadline_misses_total{model="frame_echo"} 1.0' in text
    assert 'duplex_tick_duration_seconds_count{model="frame_echo"} 5.0' in text


def test_the_grid_steps_one_period_on_and_skips_the_points_a_late_step_overran():
    grid = TickGrid(0.5)
    assert grid.first_due(3.0) == 3.5  # a frame of input arrives first
    assert grid.next_due(1.0, 1.2) == (1.5, False)
    assert grid.next_due(1.0, 1.5) == (1.5, False)  # ended on its deadline: not a miss
    assert grid.next_due(1.0, 2.2) == (2.5, True)  # 1.5 and 2.0 overran: skipped
    assert grid.next_due(1.0, 2.0) == (2.0, True)


async def test_the_tick_idles_with_no_slot_open(rig):
    await rig.open("a")
    await rig.tick(2)
    await rig.port.cleanup("a")
    await rig.clock.advance(10)
    for _ in range(20):
        await asyncio.sleep(0)
    assert rig.port.stats()["ticks"] == 2
    assert rig.clock._sleepers == []  # nothing waits on the clock: the task waits for a slot
    await rig.open("b")  # the next open starts the grid again
    await rig.tick()
    assert rig.port.stats()["ticks"] == 3


async def test_opening_and_closing_mid_stream_leaves_the_others_alone():
    speech = [tone(1, 0.3 + 0.05 * k) for k in range(8)]

    async def a_alone() -> list[np.ndarray]:
        rig = Rig()
        await rig.open("a")
        for frame in speech:
            rig.port.feed("a", frame)
            await rig.tick()
        await rig.port.shutdown()
        return [o.audio for o in rig.outputs["a"] if o.kind == "audio"]

    alone = await a_alone()
    rig = Rig()
    await rig.open("a")
    for k, frame in enumerate(speech):
        if k == 2:
            await rig.open("b")
        if k == 5:
            await rig.port.cleanup("b")
        rig.port.feed("a", frame)
        if rig.port.slot_of("b") is not None:
            rig.port.feed("b", tone(1, 0.9))
        await rig.tick()
    shared = [o.audio for o in rig.outputs["a"] if o.kind == "audio"]
    await rig.port.shutdown()
    assert len(shared) == len(alone) == 6
    for mine, theirs in zip(shared, alone, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert rig.model.batches == [1, 1, 2, 2, 2, 1, 1, 1]
    assert rig.model.opened[1] is False  # b's slot was closed in the model


async def test_slots_are_given_at_ensure_and_freed_at_cleanup():
    rig = Rig(slots=2)
    await rig.open("a")
    await rig.open("b")
    with pytest.raises(DuplexSessionError) as refused:
        await rig.port.ensure(DuplexFence("c", 0, 0), "stage0")
    assert refused.value.code == "resource_exhausted"
    assert "duplex_session_capacity_exhausted" in refused.value.message
    assert rig.port.free_slots == 0
    text = generate_latest(rig.registry).decode()
    assert 'duplex_tick_slots{model="frame_echo"} 2.0' in text
    assert 'duplex_tick_slots_active{model="frame_echo"} 2.0' in text
    await rig.port.cleanup("a")
    assert rig.port.free_slots == 1
    await rig.open("c")
    assert rig.port.slot_of("c") == 0  # a's slot, opened fresh
    assert rig.model.options[0] == {"voice": "v"}
    await rig.port.shutdown()
    assert rig.model.closed


async def test_abort_interrupts_one_slot_keeping_its_memory_and_the_speech_that_interrupted(rig):
    request_a = await rig.open("a")
    await rig.open("b")
    for _ in range(3):
        rig.port.feed("a", tone(1))
        rig.port.feed("b", tone(1))
        await rig.tick()
    assert rig.kinds("a") == rig.kinds("b") == ["audio"]
    rig.port.feed("a", tone(4))  # buffered: the speech that interrupts the model
    await rig.port.abort([request_a])
    assert rig.model.interrupts == [1, 0, 0, 0]
    for _ in range(3):
        rig.port.feed("b", tone(1))
        await rig.tick()
    # a's model drops what it was saying and hears the buffered speech; nothing of the
    # aborted request is sent (the runner re-stamps the stream after an abort)
    assert rig.kinds("a") == ["audio"]
    assert rig.kinds("b") == ["audio"] * 4
    assert rig.port.stats()["silence_frames_by_session"]["a"] == 0


async def test_an_ensure_with_a_newer_epoch_restamps_the_stream(rig):
    request = await rig.open("a")
    newer = await rig.port.ensure(DuplexFence("a", 3, 1), "stage0")
    older = await rig.port.ensure(DuplexFence("a", 2, 0), "stage0")
    assert newer != request and older != newer
    for _ in range(3):
        rig.port.feed("a", tone(1))
        await rig.tick()
    (output,) = rig.outputs["a"]
    assert (output.request_id, output.fence.epoch) == (newer, 3)


async def test_quiet_frames_end_a_response_with_listen(rig):
    await rig.open("a")
    frames = [tone(1)] * 3 + [np.zeros(FRAME_SAMPLES, np.float32)] * 6
    for frame in frames:
        rig.port.feed("a", frame)
        await rig.tick()
    # 2 frames of delay, 3 speaking, then 3 quiet ones sent and "listen"; the rest unsent
    assert rig.kinds("a") == ["audio"] * 6 + ["listen"]
    assert [o.text for o in rig.outputs["a"][:6]] == ["."] * 3 + [""] * 3


async def test_a_response_at_max_response_frames_ends_and_the_next_one_opens():
    rig = Rig(max_response_frames=4)
    await rig.open("a")
    for _ in range(12):
        rig.port.feed("a", tone(1))
        await rig.tick()
    await rig.port.shutdown()
    # 10 speaking frames: 4, listen, 4, listen, 2 (still speaking)
    assert rig.kinds("a") == ["audio"] * 4 + ["listen"] + ["audio"] * 4 + ["listen"] + ["audio"] * 2


@pytest.mark.parametrize(
    ("frame_ms", "counts"),
    [
        # Mimi's 80 ms frames: the counts the stage had as constants (6, 750, 25, 2, 3)
        (80, {"listen": 6, "response": 750, "buffered": 25, "restored": 2, "jitter": 3.0}),
        # a 1 s unit: one quiet unit ends a response, 60 s still caps one, and the input
        # bound holds a unit being filled, a late one and the next (not 2 s: 2 units)
        (1000, {"listen": 1, "response": 60, "buffered": 3, "restored": 1, "jitter": 1.25}),
    ],
)
def test_the_stage_bounds_are_times_made_whole_frames_of_the_model_clock(frame_ms, counts):
    samples = RATE * frame_ms // 1000
    model = EchoFrameModel(1, frame_samples=samples)
    port = TickBatchedStagePort(model)  # the plugin ABC's times: 480 ms and 60 s
    assert FrameClockedPlugin.listen_after_ms == 480
    assert model.frame_ms == frame_ms and port.period_s == frame_ms / 1000
    assert port.listen_after_frames == counts["listen"]
    assert port.max_response_frames == counts["response"]
    assert port.max_buffered_samples == counts["buffered"] * samples
    assert port.restored_input_frames == counts["restored"]
    assert port.max_jitter_samples == counts["jitter"] * samples
    # the plugin's own time (the echo plugin's 240 ms) is counted the same way
    plugin_frames = TickBatchedStagePort.for_plugin(EchoFramePlugin(), model).listen_after_frames
    assert plugin_frames == frames_in(240, frame_ms) == (3 if frame_ms == 80 else 1)


async def test_a_client_far_ahead_of_the_clock_is_cut_back():
    rig = Rig(max_buffered_frames=4)
    await rig.open("a")
    rig.port.feed("a", tone(10))
    stats = rig.port.stats()
    assert stats["dropped_input_frames"] == 6
    await rig.tick(5)
    assert rig.port.stats()["silence_frames"] == 1  # 4 frames were kept, the 5th is silence
    text = generate_latest(rig.registry).decode()
    await rig.port.shutdown()
    assert 'duplex_tick_input_lag_seconds_count{model="frame_echo"} 5.0' in text


async def test_nothing_is_sent_under_an_aborted_request_until_a_newer_ensure(rig):
    request = await rig.open("a")
    await rig.port.abort([request])
    for _ in range(3):
        rig.port.feed("a", tone(1))
        await rig.tick()
    assert rig.outputs["a"] == []  # the model spoke again, under the aborted request: unsent
    newer = await rig.port.ensure(DuplexFence("a", 1, 0), "stage0")
    rig.port.feed("a", tone(1))
    await rig.tick()
    assert [(o.kind, o.request_id) for o in rig.outputs["a"]] == [("audio", newer)]


def steps_history(count: int) -> ModelHistory:
    """An echo model's history of `count` frames (its records are the step numbers)."""
    return ModelHistory(4, b"".join(struct.pack("<I", n) for n in range(1, count + 1)))


async def open_with_history(rig, session_id: str, history: ModelHistory, responding=False):
    fence = DuplexFence(session_id, 0, 0)
    rig.outputs[session_id] = []
    rig.port.bind(session_id, rig.outputs[session_id].append)
    request_id = await rig.port.ensure(fence, "stage0")
    rig.port.keep_history(session_id, history, responding=responding)
    await rig.port.submit_initial(StagePlan(request_id, fence, "stage0", {}))
    # a replay starts in the tick's wait for its frame: let it, before the test moves time
    async with asyncio.timeout(10):
        while rig.port._replay_wake.is_set() and rig.port._task is not None:
            await asyncio.sleep(0)
    return request_id


async def test_every_stepped_frame_goes_to_the_history_aborted_ones_too(rig):
    history = ModelHistory(4)
    request = await open_with_history(rig, "a", history)
    for _ in range(3):
        rig.port.feed("a", tone(1))
        await rig.tick()
    await rig.port.abort([request])
    await rig.tick(2)
    assert history.frames == 5
    assert history.data == steps_history(5).data
    assert rig.model.interrupts[0] == 1 and rig.model.steps[0] == 5


async def test_a_history_the_model_refuses_fails_the_open(rig):
    history = ModelHistory(4, struct.pack("<3I", 1, 2, 2))  # a repeat: not the model's
    with pytest.raises(ValueError, match="not the steps"):
        await open_with_history(rig, "a", history)
    bad = ModelHistory(8)
    with pytest.raises(DuplexSessionError, match="8-byte records"):
        await open_with_history(rig, "b", bad)


async def test_a_step_that_failed_after_the_model_advanced_still_records_its_frames(rig):
    """`FrameStepError` carries the records of a step whose model state advanced before it
    failed: they go to the histories (else a restore would rebuild another state), and the
    responses in progress fail as for any failed step."""
    history = ModelHistory(4)
    await open_with_history(rig, "a", history)
    await rig.tick()

    def fails_after_advancing() -> None:
        raise FrameStepError("decode failed", [struct.pack("<I", 99), None, None, None])

    rig.model.on_step = fails_after_advancing
    await rig.tick()
    assert history.data == steps_history(1).data + struct.pack("<I", 99)


def test_a_frame_model_must_interrupt_without_resetting():
    """A barge-in keeps the model's memory (`interrupt_slot`), which every frame model
    says itself: there is no default that would reset it and leave its history behind."""

    class Forgetful(EchoFrameModel):
        interrupt_slot = FrameModel.interrupt_slot

    with pytest.raises(TypeError, match="interrupt_slot"):
        Forgetful(2)


async def test_a_slot_is_ready_once_it_has_stepped_its_prompt(rig):
    """The session is told once (Moshi's handshake, GPT-Live's session.started waits for it):
    not while the model still steps the slot's prompt (a persona, a voice prompt), nor while
    it replays (a `.pt` voice's prefix, a restore's history)."""
    prompt = 3
    rig.model.prompt_frames_left = lambda slot: max(0, prompt - rig.model.steps[slot])
    await rig.open("a")
    await rig.tick(2)
    assert rig.ready["a"] == 0  # 2 of the prompt's 3 frames stepped
    await rig.tick()
    assert rig.ready["a"] == 1
    await rig.tick(3)
    assert rig.ready["a"] == 1  # once
    rig.model.on_open = lambda slot, options: rig.model._replay_left.__setitem__(slot, 16)
    await rig.open("b")
    await rig.tick()  # the replay runs after this tick's step; b is not stepped yet
    assert rig.ready["b"] == 0
    await rig.tick(prompt + 1)
    assert rig.ready["b"] == 1
