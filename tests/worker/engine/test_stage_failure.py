"""A failing stage fails only its response; the session and its history go on."""

from harness.sessions import appends, make_harness, send_all, sine, types
from plugins.echo import EchoPlugin, EchoStagePort
from shared.contracts import StageOutput


class FailingPort(EchoStagePort):
    async def submit_initial(self, plan):
        await super().submit_initial(plan)
        await self.abort([plan.request_id])
        self._sessions[plan.fence.session_id].sink(
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


class PlanFailsOnce(EchoPlugin):
    """A plugin whose first plan_response raises (as a parser of client text might)."""

    failed = False

    def plan_response(self, request):
        if not self.failed:
            self.failed = True
            raise RecursionError("maximum recursion depth exceeded")
        return super().plan_response(request)


async def test_a_plan_that_raises_fails_the_response_and_the_session_goes_on():
    h = make_harness(plugin=PlanFailsOnce())
    try:
        session = await h.client.open(
            {"duplex_surface": "openai", "turn_detection": None, "extra_body": {"pace": 0}}
        )
        await session.send({"type": "response.create", "event_id": "first"})
        events = await session.until("error")
        done = next(e for e in events if e.wire_type == "response.done")
        assert done.response["status"] == "failed"
        assert (events[-1].code, events[-1].related_event_id) == ("internal_error", "first")
        await session.send({"type": "response.create", "event_id": "second"})
        events = await session.until("response.done")
        assert "error" not in types(events)  # not refused as a second active response
        assert events[-1].response["status"] == "completed"
    finally:
        await h.manager.shutdown()
