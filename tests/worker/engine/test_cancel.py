"""Epoch fencing: cancels emit the cancelled chain first and nothing of the old epoch follows."""

import asyncio

from harness.sessions import appends, make_harness, send_all, sine, types
from plugins.echo import EchoStagePort
from shared.contracts import StageOutput
from tests.worker.engine.test_echo_turn import RESPONSE_END

CANCELLED_CHAIN = RESPONSE_END  # a cancel closes what was opened, in the same order
REAL_TIME = {"extra_body": {"pace": 1}}


async def start_speaking(session, seconds: float = 2.0):
    """Commit `seconds` of audio and wait for the first audio delta of the response."""
    await send_all(session, appends(sine(16000, seconds), 16000))
    await session.send({"type": "input.commit"})
    events = await session.until("response.output_audio.delta")
    return next(e for e in events if e.wire_type == "response.created").response_id


class LateOutputPort(EchoStagePort):
    """Forces the race: one more audio output reaches the runner's mailbox while
    the abort is under way, as a real engine's in-flight output would."""

    def __init__(self) -> None:
        super().__init__()
        self.late_outputs = 0
        self.aborted: list[str] = []
        self.plans = {}

    async def submit_initial(self, plan):
        self.plans[plan.request_id] = plan
        await super().submit_initial(plan)

    async def abort(self, request_ids):
        for request_id in request_ids:
            fence = self.plans[request_id].fence
            late = StageOutput(
                request_id, fence, "audio", audio=sine(24000, 0.1), sample_rate_hz=24000
            )
            self._sessions[fence.session_id].sink(late)
            self.late_outputs += 1
        self.aborted += list(request_ids)
        await asyncio.sleep(0.02)  # a slow abort: the mailbox receives the late output meanwhile
        await super().abort(request_ids)


async def test_cancel_mid_response_drops_everything_of_the_old_epoch():
    port = LateOutputPort()
    h = make_harness(port=port)
    try:
        session = await h.open(REAL_TIME)
        response_id = await start_speaking(session)
        await session.send({"type": "response.cancel", "event_id": "stop"})
        events = await session.until("rate_limits.updated")
        chain = events[-len(CANCELLED_CHAIN) :]
        assert types(chain) == CANCELLED_CHAIN
        assert all(
            e.wire_type.startswith("response.output_audio") for e in events[: -len(CANCELLED_CHAIN)]
        )
        done = chain[-2]
        assert done.response_id == response_id and done.response["status"] == "cancelled"
        assert done.response["status_details"] == {
            "type": "cancelled",
            "reason": "client_cancelled",
        }
        await asyncio.sleep(0.3)  # time itself is tested: 3 more chunks' worth of real time
        assert session.pending() == []  # no audio of the old epoch after its response.done
        runner = h.manager.table.runner(session.session_id)
        assert port.late_outputs == 1 and runner.dropped_stale_outputs == 1
        request_id = runner.session.last_response.request_id
        assert port.aborted == [request_id]
        assert request_id.startswith("duplex-s.") and request_id.endswith(".e.0.r.stage0")
        assert port.running_requests() == []  # generation really stopped
        assert runner.session.epoch == 1 and runner.session.active is None
    finally:
        await h.manager.shutdown()


async def test_cancel_without_an_active_response(harness):
    session = await harness.open()
    await session.send({"type": "response.cancel", "event_id": "c"})
    error = await session.recv()
    assert (error.code, error.related_event_id) == ("response_not_active", "c")
    await session.send({"type": "output_audio_buffer.clear"})
    assert (await session.recv()).code == "response_not_active"


async def test_cancel_of_another_response_id_is_refused():
    h = make_harness()
    try:
        session = await h.open(REAL_TIME)
        await start_speaking(session)
        await session.send({"type": "response.cancel", "response_id": "resp_other"})
        events = await session.until("error")
        assert events[-1].code == "response_not_active"
        assert "response.done" not in types(events)
    finally:
        await h.manager.shutdown()


async def test_output_audio_buffer_clear_cancels_and_confirms():
    h = make_harness()
    try:
        session = await h.open(REAL_TIME)
        response_id = await start_speaking(session)
        await session.send({"type": "output_audio_buffer.clear"})
        events = await session.until("output_audio_buffer.cleared")
        assert types(events)[-8:] == [*CANCELLED_CHAIN, "output_audio_buffer.cleared"]
        assert events[-1].response_id == response_id
        await session.send({"type": "output_audio_buffer.clear"})  # idempotent once ended
        assert (await session.recv()).wire_type == "output_audio_buffer.cleared"
    finally:
        await h.manager.shutdown()


async def test_barge_in_command():
    h = make_harness()
    try:
        session = await h.open(REAL_TIME)
        await start_speaking(session)
        await session.send({"type": "barge_in"})
        events = await session.until("rate_limits.updated")
        done = events[-2]
        assert done.response["status_details"]["reason"] == "barge_in"
        assert h.manager.table.runner(session.session_id).session.epoch == 1
    finally:
        await h.manager.shutdown()


async def test_input_cancel_clears_input_and_cancels():
    h = make_harness()
    try:
        session = await h.open(REAL_TIME)
        await start_speaking(session)
        await send_all(session, appends(sine(16000, 0.2), 16000))
        await session.send({"type": "input.cancel"})
        events = await session.until("input_audio_buffer.cleared")
        assert types(events)[-8:] == [*CANCELLED_CHAIN, "input_audio_buffer.cleared"]
        await session.send({"type": "input_audio_buffer.commit"})
        assert (await session.until("error"))[-1].code == "input_audio_buffer_empty"
    finally:
        await h.manager.shutdown()


async def test_new_commit_replaces_the_active_response():
    h = make_harness()
    try:
        session = await h.open(REAL_TIME)
        first = await start_speaking(session)
        await send_all(session, appends(sine(16000, 0.3), 16000))
        await session.send({"type": "input.commit"})
        events = await session.until("response.created")
        done = next(e for e in events if e.wire_type == "response.done")
        assert (
            done.response_id == first
            and done.response["status_details"]["reason"] == "new_response"
        )
        assert events[-1].response_id != first
    finally:
        await h.manager.shutdown()


async def test_clear_drops_appends_in_flight(harness):
    session = await harness.open()
    await send_all(session, appends(sine(16000, 0.5), 16000))
    await session.send({"type": "input_audio_buffer.clear"})  # before the appends were processed
    await session.send({"type": "input_audio_buffer.commit", "event_id": "after"})
    events = await session.until("error")
    assert "input_audio_buffer.cleared" in types(events)
    assert events[-1].code == "input_audio_buffer_empty"
    assert harness.manager.table.runner(session.session_id).session.pending_input_bytes == 0
