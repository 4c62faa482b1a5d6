"""The tick-batched stage when things happen at once: a close while the slot opens, two
cleanups of one session, an abort while a step runs, a step or a reset that raises, and
what a stream's checkpoint asks to replay. Each drives the model thread with events, never
with the clock of the machine."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from harness.frame_models import RATE, EchoFrameModel, ManualClock, tone
from harness.sessions import appends, types
from services.worker.engine.checkpoint import read_checkpoint
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.contracts import DuplexFence, StageOutput, StagePlan
from shared.protocol.duplex import CancelResponse
from tests.worker.engine.test_native_stream import QUIET, Rig

WAIT_S = 5


async def until(condition, what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.005)


def slow_open(rig: Rig) -> tuple[threading.Event, threading.Event]:
    """`open_slot` holds the model thread until released (as a PersonaPlex prompt does)."""
    started, release = threading.Event(), threading.Event()
    real_open = rig.model.open_slot

    def held_open(slot, options):
        started.set()
        release.wait(WAIT_S)
        real_open(slot, options)

    rig.model.open_slot = held_open
    return started, release


async def test_a_session_closed_while_its_slot_opens_closes_the_slot():
    rig = Rig(slots=1, max_sessions=1)
    started, release = slow_open(rig)
    try:
        first = await rig.client.open({})
        await asyncio.to_thread(started.wait, WAIT_S)
        closing = asyncio.create_task(rig.manager.close(first.session_id))  # client gone
        release.set()
        await closing
        await until(lambda: rig.port.free_slots == 1, "the slot freed")
        assert rig.model.opened[0] is False  # closed in the model, not only in the stage
        for _ in range(2):  # the slot serves the next sessions
            session = await rig.open()
            assert [e.code for e in session.pending() if e.wire_type == "error"] == []
            await rig.manager.close(session.session_id)
    finally:
        release.set()
        await rig.manager.shutdown()


async def test_two_cleanups_of_one_session_close_its_slot_once():
    """manager.close and the reaper's retry may clean one session up at the same time."""
    port, model, _, outputs = stage()
    await open_stream(port, outputs, "a")
    closes: list[int] = []
    real_close = model.close_slot
    model.close_slot = lambda slot: (closes.append(slot), real_close(slot))
    results = await asyncio.gather(port.cleanup("a"), port.cleanup("a"), return_exceptions=True)
    await port.shutdown()
    assert results == [None, None] and closes == [0] and port.free_slots == 2


async def test_an_abort_during_a_step_drops_what_the_step_made():
    port, model, clock, outputs = stage()
    request = await open_stream(port, outputs, "a")
    in_step, release = threading.Event(), threading.Event()
    model.on_step = lambda: (in_step.set(), release.wait(WAIT_S))
    port.feed("a", tone(1))
    await clock.advance_to(await clock.next_sleeper())
    await asyncio.to_thread(in_step.wait, WAIT_S)
    abort = asyncio.create_task(port.abort([request]))
    await asyncio.sleep(0)  # the abort has fenced the slot; its reset waits for the step
    release.set()
    await abort
    await port.wait_ticks(1)
    await port.shutdown()
    assert outputs["a"] == []
    # the slot's "ready" is the session's, no response's: an abort does not take it back
    assert outputs["ready"] == ["a"]


async def test_a_failing_step_fails_the_response_and_the_tick_goes_on():
    port, model, clock, outputs = stage()
    await open_stream(port, outputs, "a")

    async def tick() -> None:
        port.feed("a", tone(1))
        count = port.ticks + 1
        await clock.advance_to(await clock.next_sleeper())
        await port.wait_ticks(count)

    await tick()

    def boom() -> None:
        raise RuntimeError("out of memory")

    model.on_step = boom
    await tick()
    model.on_step = None
    await tick()
    await port.shutdown()
    kinds = [output.kind for output in outputs["a"]]
    assert kinds == ["audio", "error", "audio"]
    assert outputs["a"][1].error_code == "runtime_data_plane_stream_failed"


async def test_an_interrupt_that_raises_does_not_mute_the_stream():
    rig = Rig()
    try:
        session = await rig.open({"duplex_surface": "openai"})
        await rig.say(session, tone(4))
        await rig.tick(3)
        await session.until("response.output_audio.delta")

        def broken(slot):
            raise RuntimeError("interrupt failed")

        rig.model.interrupt_slot = broken
        await session.send(CancelResponse(event_id="c1"))
        await session.until("response.done")
        await rig.settle(session)
        session.pending()
        await rig.say(session, tone(4), QUIET, QUIET, QUIET, QUIET)
        await rig.tick(9)
        await rig.settle(session)
        assert "response.created" in types(session.pending())  # the model speaks again
    finally:
        await rig.manager.shutdown()


async def test_a_streams_checkpoint_never_asks_to_replay_its_whole_input():
    """A stream's input is never replayed into a model (its state does not move): the
    checkpoint's applied mark follows the commands, not the stream's first append."""
    rig = Rig()
    try:
        opened = await rig.client.open({})
        runner = rig.manager.table.runner(opened.session_id)
        await runner.settle_input()
        seq = 0
        for command in appends(np.zeros(RATE * 48, np.float32), RATE, chunk_ms=80):
            seq += 1  # 600 appends: 48 s, past the ledger's window
            await rig.manager.submit(opened.session_id, command, (1, seq))
        await runner.settle_input()
        document = read_checkpoint(rig.manager.moves.snapshot(opened.session_id))
        assert document["applied"][1] > seq - 10
    finally:
        await rig.manager.shutdown()


def stage(slots: int = 2):
    clock = ManualClock()
    model = EchoFrameModel(slots, delay_frames=0)
    port = TickBatchedStagePort(model, clock=clock, listen_after_frames=3)
    return port, model, clock, {}


async def open_stream(port: TickBatchedStagePort, outputs: dict, session_id: str) -> str:
    outputs[session_id] = []
    ready = outputs.setdefault("ready", [])  # the sessions told their slot is ready

    def sink(output: StageOutput) -> None:
        (ready.append(session_id) if output.kind == "ready" else outputs[session_id].append(output))

    port.bind(session_id, sink)
    fence = DuplexFence(session_id, 0, 0)
    request_id = await port.ensure(fence, "stage0")
    await port.submit_initial(StagePlan(request_id, fence, "stage0", {}))
    return request_id
