"""A frame-clocked plugin's session through the SessionManager and its runner: the model's
speech opens model-native responses and its quiet ends them, barge-in cancels and interrupts
its slot, VAD overlap does not cancel, response.create is refused, a commit plans nothing."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from harness.frame_models import RATE, EchoFramePlugin, ManualClock, tone
from harness.sessions import appends, types
from services.worker.control.manager import SessionManager
from services.worker.engine.native_stream import TURN_WINDOW_MS
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.client.inline import InlineDuplexClient, InlineEventRouter
from shared.contracts import (
    SIZED_RECORDS,
    DuplexRuntimeConfigError,
    DuplexSessionError,
    SessionRuntimeConfig,
)
from shared.protocol.duplex import BargeIn, CancelResponse, Commit, CreateResponse
from tests.worker.session_parts import LoudnessVad

QUIET = np.zeros(1920, np.float32)
#: server VAD at round numbers (tests/worker/conftest.py's), for a 24 kHz model
VAD = {
    "turn_detection": {
        "type": "server_vad",
        "prefix_padding_ms": 0,
        "min_speech_duration_ms": 64,
        "silence_duration_ms": 64,
    }
}


class Rig:
    def __init__(
        self, slots: int = 4, max_sessions: int = 4, plugin: EchoFramePlugin | None = None
    ) -> None:
        self.plugin = plugin or EchoFramePlugin(slots=slots)
        self.model = self.plugin.frame_model(max_sessions)
        self.clock = ManualClock()
        self.port = TickBatchedStagePort.for_plugin(self.plugin, self.model, clock=self.clock)
        self.router = InlineEventRouter()
        runtime = SessionRuntimeConfig(max_sessions=max_sessions)
        self.manager = SessionManager(
            self.plugin, runtime, self.router, port=self.port, vad_backend=LoudnessVad
        )
        self.client = InlineDuplexClient(self.manager, self.router)

    async def open(self, session: dict | None = None):
        opened = await self.client.open(session or {})
        await self.manager.table.runner(opened.session_id).settle_input()  # its stream is open
        return opened

    async def say(self, opened, *frames: np.ndarray) -> None:
        """Frames of input, applied (fed to the slot) before the clock moves."""
        for command in appends(np.concatenate(frames), RATE, chunk_ms=80):
            await opened.send(command)
        await self.manager.table.runner(opened.session_id).settle_input()

    async def tick(self, count: int = 1) -> None:
        for _ in range(count):
            target = self.port.ticks + 1
            await self.clock.advance_to(await self.clock.next_sleeper())
            await asyncio.wait_for(self.port.wait_ticks(target), 5)

    async def settle(self, opened) -> None:
        """The stage outputs of the ticks so far are applied (they precede the barrier)."""
        await self.manager.table.runner(opened.session_id).settle_input()


@pytest.fixture
async def rig():
    made = Rig()
    yield made
    await made.manager.shutdown()


async def test_the_model_speaking_opens_a_response_and_its_quiet_completes_it(rig):
    session = await rig.open()
    await rig.say(session, tone(3), QUIET, QUIET, QUIET, QUIET, QUIET)
    await rig.tick(8)  # 2 frames of delay, 3 speaking, 3 quiet: "listen"
    events = await session.until("rate_limits.updated")
    assert types(events) == [
        "input_audio_buffer.speech_started",
        "response.created",
        "conversation.item.added",
        "conversation.item.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.speak",
        *["response.output_audio.delta", "response.output_audio_transcript.delta"] * 6,
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
        "rate_limits.updated",
    ]
    done = events[-2]
    assert done.response["status"] == "completed"
    assert events[-6].transcript == "..."  # one "." per speaking frame
    assert done.response["metadata"]["playback"]["generated_ms"] == pytest.approx(480)


async def test_barge_in_cancels_interrupts_the_slot_and_the_next_speech_opens_a_new_response(rig):
    session = await rig.open()
    other = await rig.open()
    await rig.say(session, tone(6))
    await rig.say(other, tone(6))
    await rig.tick(4)  # both speak from the 3rd tick
    first = (await session.until("response.output_audio.delta"))[-1]
    await session.send(BargeIn(event_id="b1"))
    cancelled = await session.until("response.done")
    assert cancelled[-1].response["status"] == "cancelled"
    assert cancelled[-1].response["status_details"]["reason"] == "barge_in"
    await rig.settle(session)  # the barge-in's handling (its abort) has ended
    slot = rig.port.slot_of(session.session_id)
    assert rig.model.interrupts[slot] == 1 and rig.model.steps[slot] > 0
    # the other session's slot was not touched
    assert sum(rig.model.interrupts) == 1
    await rig.say(session, tone(3))
    await rig.tick(3)
    created = (await session.until("response.created"))[-1]
    assert created.response_id != cancelled[-1].response_id
    assert created.response["metadata"]["duplex_event"]["epoch"] == 1
    assert first.response_id == cancelled[-1].response_id
    # the other session's response went on through all of it
    others = [e for e in other.pending() if e.wire_type == "response.output_audio.delta"]
    assert len(others) == 5 and {e.response_id for e in others} == {others[0].response_id}


async def test_response_cancel_interrupts_the_slot_too(rig):
    session = await rig.open()
    await rig.say(session, tone(4))
    await rig.tick(3)
    await session.until("response.output_audio.delta")
    await session.send(CancelResponse(event_id="c1"))
    done = (await session.until("response.done"))[-1]
    assert done.response["status"] == "cancelled"
    await rig.settle(session)
    assert rig.model.interrupts == [1, 0, 0, 0]


async def test_speech_over_the_response_is_reported_and_does_not_cancel_it():
    rig = Rig()
    try:
        session = await rig.open(VAD)
        await rig.say(session, tone(2), QUIET, QUIET, QUIET)
        await rig.tick(3)  # the model speaks from the 3rd tick on
        await session.until("response.output_audio.delta")
        await rig.say(session, tone(3))  # the user talks over it: server VAD hears speech
        await rig.tick(4)
        events = await session.until("rate_limits.updated")  # the model stopped on its own
        decisions = [e for e in events if e.wire_type == "overlap.decision"]
        assert len(decisions) == 1
        assert (decisions[0].action, decisions[0].reason) == ("listen", "model_native")
        assert events[-2].response["status"] == "completed"
        assert "input_audio_buffer.speech_started" in types(events)
    finally:
        await rig.manager.shutdown()


async def test_response_create_is_refused(rig):
    session = await rig.open()
    await session.send(CreateResponse(event_id="r1"))
    error = (await session.until("error"))[-1]
    assert error.code == "unsupported_native_response_options"
    assert "the model decides when it speaks" in error.message


async def test_a_commit_commits_the_turn_and_plans_no_response(rig):
    session = await rig.open()
    await rig.say(session, tone(2))
    await session.send(Commit(event_id="c1"))
    await rig.settle(session)
    events = session.pending()
    assert "input_audio_buffer.committed" in types(events)
    assert "response.created" not in types(events)
    assert rig.manager.table.runner(session.session_id).session.active is None
    # nothing will ever answer the turn (the model speaks when it will): its audio is not
    # kept for a response.create, nor carried in the checkpoint
    checkpoint = orjson.loads(rig.manager.moves.snapshot(session.session_id))
    assert checkpoint["pending_turns"] == [] and checkpoint["input"] is None


async def test_auto_response_false_is_refused_at_open_and_at_update(rig):
    with pytest.raises(DuplexSessionError) as refused:
        await rig.client.open({"extra_body": {"auto_response": False}})
    assert refused.value.code == "invalid_duplex_runtime_config"
    assert rig.manager.table.slots_in_use == 0
    session = await rig.open()
    await session.send(
        {"type": "session.update", "session": {"extra_body": {"auto_response": False}}}
    )
    error = (await session.until("error"))[-1]
    assert error.code == "invalid_duplex_runtime_config"


async def test_admission_is_refused_when_the_model_slots_are_taken():
    rig = Rig(slots=2, max_sessions=4)
    try:
        await rig.open()
        await rig.open()
        with pytest.raises(DuplexSessionError) as refused:
            await rig.client.open({})
        assert refused.value.code == "resource_exhausted"
        assert rig.manager.table.slots_in_use == 2
        first = rig.manager.table.live_ids()[0]
        await rig.manager.close(first)
        assert rig.port.free_slots == 1  # close freed its slot
        await rig.open()
    finally:
        await rig.manager.shutdown()
    assert rig.model.closed


async def test_a_stream_never_committed_keeps_only_its_window_of_input(rig):
    session = await rig.open()
    seconds = (TURN_WINDOW_MS + 15_000) // 1000
    frames = [QUIET] * (seconds * 1000 // 80)
    await rig.say(session, *frames)
    ledger = rig.manager.table.runner(session.session_id).session.input
    assert ledger.stream_ms == len(frames) * 80  # all of it was applied
    assert ledger.samples * 1000 // RATE <= TURN_WINDOW_MS + 10_000


async def restore_elsewhere(
    other: Rig, session_id: str, checkpoint: bytes, history: bytes, reason: str = "worker_lost"
) -> None:
    """The other end of a move: `other`'s worker serves the session from its checkpoint
    and model history (at owner generation 2)."""
    await other.manager.moves.restore(
        session_id, checkpoint, owner_generation=2, reason=reason, model_history=history
    )


async def restored(rig: Rig) -> None:
    """Until every restore on `rig`'s stage has replayed its history (it runs in the tick's
    wait for its next frame, the clock standing still)."""
    async with asyncio.timeout(10):
        while not rig.port.restore_progress() or not all(
            p.done for p in rig.port.restore_progress()
        ):
            await asyncio.sleep(0.001)


async def test_a_failed_over_session_gets_its_models_memory_back_and_speaks_again(rig):
    """Restored from its checkpoint and model history: the slot replays the history (the
    echo model counts on from it), the response the lost worker was speaking ends
    `incomplete` with its words kept and no error event, and the model speaks again."""
    session = await rig.open()
    await rig.say(session, tone(4))
    await rig.tick(3)
    await session.until("response.output_audio.delta")  # mid-response when the worker goes
    checkpoint = rig.manager.moves.snapshot(session.session_id)
    history = rig.manager.moves.model_history(session.session_id)
    assert history is not None and history.frames >= 3
    other = Rig()
    try:
        await restore_elsewhere(other, session.session_id, checkpoint, bytes(history.data))
        runner = other.manager.table.runner(session.session_id)
        await runner.settle_input()
        slot = other.port.slot_of(session.session_id)
        assert other.model.restored[slot] == history.frames  # its memory, not a fresh slot
        queue = other.router.queue(session.session_id)
        events = [queue.get_nowait() for _ in range(queue.qsize())]
        (done,) = [e for e in events if e.wire_type == "response.done"]
        assert done.response["status"] == "incomplete"  # the lost worker's response
        assert done.response["status_details"]["reason"] == "worker_lost"
        assert not [e for e in events if e.wire_type == "error"]
        await other.tick(2)  # the replay runs between ticks
        for command in appends(tone(3), RATE, chunk_ms=80):
            await other.manager.submit(session.session_id, command)
        await runner.settle_input()
        await other.tick(3)
        await runner.settle_input()
        assert other.model.steps[slot] > history.frames  # counting on from its history
        kinds = [queue.get_nowait().wire_type for _ in range(queue.qsize())]
        assert "response.created" in kinds and "response.output_audio.delta" in kinds
    finally:
        await other.manager.shutdown()


async def test_a_history_of_another_record_size_is_refused_not_replayed(rig):
    """A history written by a worker of another version (its records another size, as
    Redis's `model_record_bytes` says) is refused at the move, with both sizes, never
    replayed misaligned; so is one that is not whole records; the slot is not held."""
    session = await rig.open()
    await rig.say(session, tone(2))
    await rig.tick(2)
    checkpoint = rig.manager.moves.snapshot(session.session_id)
    other = Rig()
    try:
        with pytest.raises(DuplexSessionError, match=r"8-byte records, .* makes 4-byte ones"):
            await other.manager.moves.restore(
                session.session_id,
                checkpoint,
                owner_generation=2,
                reason="worker_lost",
                model_history=bytes(16),
                model_record_bytes=8,
            )
        with pytest.raises(DuplexSessionError, match=r"sized records, .* makes 4-byte ones"):
            await other.manager.moves.restore(  # written by a model of sized records
                session.session_id,
                checkpoint,
                owner_generation=2,
                reason="worker_lost",
                model_history=bytes(16),
                model_record_bytes=SIZED_RECORDS,
            )
        with pytest.raises(DuplexSessionError, match="not whole 4-byte records"):
            await other.manager.moves.restore(
                session.session_id,
                checkpoint,
                owner_generation=2,
                reason="worker_lost",
                model_history=bytes(10),
            )
        assert other.port.free_slots == other.model.slots
    finally:
        await other.manager.shutdown()


async def test_a_drained_session_goes_on_with_the_response_it_was_speaking(rig):
    """A drain's hand-off of a native session mid-response: no response.done on the old
    worker's side, the final checkpoint carries no input audio, and on the new worker the
    model's speech goes on as deltas of the same response, its history counting on."""
    session = await rig.open()
    await rig.say(session, tone(8))
    await rig.tick(4)
    spoken = (await session.until("response.output_audio.delta"))[-1]
    final = await rig.manager.moves.hand_off(session.session_id)
    history = rig.manager.moves.model_history(session.session_id)
    assert history is not None
    assert "response.done" not in types(session.pending())
    checkpoint = orjson.loads(final)
    assert checkpoint["input"] is None and checkpoint["active"]["id"] == spoken.response_id
    other = Rig()
    try:
        await restore_elsewhere(
            other, session.session_id, final, bytes(history.data), reason="drain"
        )
        runner = other.manager.table.runner(session.session_id)
        await runner.settle_input()
        await restored(other)  # in the tick's wait: the slot steps from the next frame on
        # the user goes on talking, so the echo goes on speaking: less than its
        # listen_after_frames of quiet (its 2-frame delay starts over at a restore)
        for command in appends(tone(4), RATE, chunk_ms=80):
            await other.manager.submit(session.session_id, command)
        await runner.settle_input()
        await other.tick(4)
        await runner.settle_input()
        queue = other.router.queue(session.session_id)
        events = [queue.get_nowait() for _ in range(queue.qsize())]
        deltas = [e for e in events if e.wire_type == "response.output_audio.delta"]
        assert deltas and {e.response_id for e in deltas} == {spoken.response_id}
        assert "response.created" not in types(events) and "error" not in types(events)
        slot = other.port.slot_of(session.session_id)
        assert other.model.steps[slot] > history.frames
    finally:
        await other.manager.shutdown()


async def test_a_restore_whose_replay_fails_ends_the_session_and_frees_its_slot(rig):
    """The model cannot rebuild the slot from the history (a replay that raises): the
    client hears `worker_lost`, then `session.closed`, and the slot is free again; no
    session is left live with a slot that never steps."""
    session = await rig.open()
    await rig.say(session, tone(2))
    await rig.tick(2)
    checkpoint = rig.manager.moves.snapshot(session.session_id)
    history = rig.manager.moves.model_history(session.session_id)
    assert history is not None and history.frames
    other = Rig()

    def broken(slot: int, frames: int) -> int:
        raise RuntimeError("out of memory")

    other.model.replay_work = broken
    try:
        await restore_elsewhere(other, session.session_id, checkpoint, bytes(history.data))
        queue = other.router.queue(session.session_id)
        # the replay's first chunk runs in the tick's wait for its frame, and fails
        seen = []
        while "session.closed" not in [e.wire_type for e in seen]:
            seen.append(await asyncio.wait_for(queue.get(), 5))
        errors = [e for e in seen if e.wire_type == "error"]
        assert [e.code for e in errors] == ["worker_lost"]
        assert seen[-1].reason == "worker_lost"
        assert other.port.free_slots == other.model.slots
    finally:
        await other.manager.shutdown()


def _fails_to_open(error: Exception):
    def on_open(slot, options):
        raise error

    return on_open


@pytest.mark.parametrize(
    "error, code, param",
    [
        (RuntimeError("out of GPU memory"), "runtime_data_plane_stream_failed", None),
        (
            DuplexRuntimeConfigError(
                "invalid_duplex_runtime_config", "voice prompt BLIP.wav is too short", param="voice"
            ),
            "invalid_duplex_runtime_config",
            "voice",
        ),
    ],
)
async def test_a_stream_that_cannot_start_ends_the_session_and_gives_its_slot_back(
    rig, error, code, param
):
    rig.model.on_open = _fails_to_open(error)
    session = await rig.client.open({})  # session.created: the open does not wait for the slot
    events = await session.until("session.closed")
    assert types(events) == ["error", "session.closed"]
    assert events[0].code == code and events[0].param == param
    assert "out of GPU memory" in events[0].message or "too short" in events[0].message
    assert events[1].reason == "runtime_data_plane_stream_failed"
    # no session is left mute: nothing held, the slot is free again
    assert rig.manager.table.live_ids() == [] and rig.manager.table.slots_in_use == 0
    assert rig.port.free_slots == rig.model.slots and not any(rig.model.opened)
    rig.model.on_open = None
    session = await rig.open()
    await rig.say(session, tone(3), QUIET, QUIET, QUIET, QUIET, QUIET)
    await rig.tick(8)
    assert "response.done" in types(await session.until("response.done"))


async def test_a_restore_whose_stream_cannot_start_ends_the_session_and_keeps_no_slot(rig):
    session = await rig.open()
    checkpoint = rig.manager.moves.snapshot(session.session_id)
    other = Rig()
    other.model.on_open = _fails_to_open(RuntimeError("out of GPU memory"))
    try:
        await other.manager.moves.restore(
            session.session_id, checkpoint, owner_generation=2, reason="worker_lost"
        )
        moved = other.router.queue(session.session_id)
        events = [await asyncio.wait_for(moved.get(), 5) for _ in range(2)]
        assert types(events) == ["error", "session.closed"]
        assert events[0].code == "runtime_data_plane_stream_failed"
        assert other.manager.table.live_ids() == [] and other.manager.table.slots_in_use == 0
        assert other.port.free_slots == other.model.slots
    finally:
        await other.manager.shutdown()
