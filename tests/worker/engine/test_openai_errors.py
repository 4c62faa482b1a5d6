"""The refusals of `response.cancel` and `response.create` carry OpenAI's codes on the openai
surface (framework findings B and E: Pipecat treats any other code as fatal, LiveKit skips
errors whose message starts with "Cancellation failed"); the duplex surface keeps its own.
Every event of the openai session is checked against GA's types."""

import pytest

from harness.sessions import appends, make_harness, send_all, sine
from services.worker.engine.handlers import dispatch
from shared.contracts import DuplexSessionError
from shared.protocol.duplex import ERROR_CODES, CancelResponse, Commit, CreateResponse
from tests.protocol.ga_events import check_ga_event
from tests.worker.session_parts import RecordingPort, close_parts, make_parts

OPENAI = {"duplex_surface": "openai", "turn_detection": None, "extra_body": {"pace": 0}}
DUPLEX = {"turn_detection": None, "extra_body": {"pace": 0}}


async def refusal(coro) -> DuplexSessionError:
    with pytest.raises(DuplexSessionError) as info:
        await coro
    return info.value


def test_the_codes_are_in_the_table_as_invalid_request_errors():
    for code in ("response_cancel_not_active", "conversation_already_has_active_response"):
        assert ERROR_CODES[code].error_type == "invalid_request_error"
        assert ERROR_CODES[code].retryable is None


@pytest.mark.parametrize(
    "session, code, message",
    [
        (OPENAI, "response_cancel_not_active", "Cancellation failed: no active response found"),
        (DUPLEX, "response_not_active", "no active response to cancel"),
    ],
)
async def test_a_cancel_with_nothing_active(session, code, message):
    parts = await make_parts(session)
    try:
        error = await refusal(dispatch(parts.ctx, CancelResponse()))
        assert (error.code, error.message) == (code, message)
        response = await parts.start_response()
        other = CancelResponse(response_id="resp_other")  # not the active one: the same refusal
        assert (await refusal(dispatch(parts.ctx, other))).code == code
        assert parts.session.active is response
    finally:
        await close_parts(parts)


@pytest.mark.parametrize(
    "session, code",
    [(OPENAI, "conversation_already_has_active_response"), (DUPLEX, "response_already_active")],
)
async def test_a_create_while_a_response_is_active(session, code):
    parts = await make_parts(session)
    try:
        response = await parts.start_response()
        error = await refusal(dispatch(parts.ctx, CreateResponse(), in_order=True))
        assert error.code == code and response.response_id in error.message
        assert parts.session.active is response  # the refusal changed nothing
    finally:
        await close_parts(parts)


async def test_the_openai_client_gets_ga_errors_and_the_session_goes_on():
    h = make_harness(port=RecordingPort())  # a stage that never answers: the response stays
    try:
        session = await h.client.open(OPENAI)
        await session.send({"type": "response.cancel", "event_id": "c1"})
        error = await session.recv()
        check_ga_event(error.to_dict())
        assert (error.code, error.message, error.related_event_id) == (
            "response_cancel_not_active",
            "Cancellation failed: no active response found",
            "c1",
        )
        assert error.to_dict()["error"]["type"] == "invalid_request_error"
        await send_all(session, appends(sine(24000, 0.2), 24000))
        await session.send(Commit())
        await session.send(CreateResponse())
        await session.until("response.created")
        await session.send({"type": "response.create", "event_id": "c2"})
        error = (await session.until("error"))[-1]
        check_ga_event(error.to_dict())
        assert (error.code, error.related_event_id) == (
            "conversation_already_has_active_response",
            "c2",
        )
        await session.send(CancelResponse())  # the first response is still the active one
        done = (await session.until("response.done"))[-1]
        assert done.response["status_details"] == {
            "type": "cancelled",
            "reason": "client_cancelled",
        }
    finally:
        await h.manager.shutdown()
