"""A failing stage fails only its response; the session and its history go on."""

from harness.sessions import appends, make_harness, send_all, sine, types
from plugins.echo import EchoStagePort
from shared.contracts import StageOutput


class FailingPort(EchoStagePort):
    async def submit_initial(self, plan):
        await super().submit_initial(plan)
        await self.abort([plan.request_id])
        self._sinks[plan.fence.session_id](
            StageOutput(
                plan.request_id,
                plan.fence,
                "error",
                error_code="runtime_data_plane_stream_failed",
                message="stage worker died",
            )
        )


class BrokenSubmitPort(EchoStagePort):
    async def submit_initial(self, plan):
        raise RuntimeError("engine unreachable")


async def run_turn(session):
    await send_all(session, appends(sine(16000, 0.3), 16000))
    await session.send({"type": "input.commit", "event_id": "turn"})
    return await session.until("error")


async def test_stage_error_fails_the_response_and_leaves_no_history():
    h = make_harness(port=FailingPort())
    try:
        session = await h.open()
        events = await run_turn(session)
        assert types(events)[-4:] == [
            "conversation.item.done",
            "response.done",
            "rate_limits.updated",
            "error",
        ]
        done = events[-3]
        assert done.response["status"] == "failed"
        assert done.response["status_details"]["reason"] == "runtime_data_plane_stream_failed"
        assert done.response["metadata"]["committed"] is False
        assert (
            events[-1].code == "runtime_data_plane_stream_failed"
            and events[-1].error_type == "server_error"
        )
        await session.send(
            {"type": "conversation.item.retrieve", "item_id": done.response["output"][0]["id"]}
        )
        assert (await session.recv()).code == "item_not_found"
        await session.send({"type": "session.heartbeat"})
        assert (await session.recv()).wire_type == "session.heartbeat_ack"  # the session lives on
    finally:
        await h.manager.shutdown()


async def test_submit_failure_fails_the_response():
    h = make_harness(port=BrokenSubmitPort())
    try:
        session = await h.open()
        events = await run_turn(session)
        assert (
            events[-1].code == "runtime_data_plane_stream_failed"
            and events[-1].related_event_id == "turn"
        )
        assert (
            next(e for e in events if e.wire_type == "response.done").response["status"] == "failed"
        )
    finally:
        await h.manager.shutdown()
