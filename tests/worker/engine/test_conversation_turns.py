"""`response.create` with no committed audio on the openai surface (framework finding D):
GA answers from the conversation, so the model speaks first when there is nothing (Pipecat's
canonical start) and answers the client's user text items (Pipecat replays its context as
one `input_text` message). The duplex surface keeps its refusals (contract 4.3). Every
event of the openai session is checked against GA's types."""

import pytest

from harness.sessions import make_harness
from services.worker.engine.handlers import conversation_turn, dispatch
from shared.contracts import DuplexSessionError
from shared.protocol.duplex import CreateItem, CreateResponse
from tests.protocol.ga_events import check_ga_event
from tests.worker.engine.test_tool_calls import recorded_requests
from tests.worker.session_parts import close_parts, make_parts

OPENAI = {"duplex_surface": "openai", "turn_detection": None, "extra_body": {"pace": 0}}
#: an openai response that said words without audio (echo's answer to a turn without audio)
WORDS_ONLY = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "conversation.item.created",
    "response.content_part.added",
    "response.output_audio_transcript.delta",
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
    "rate_limits.updated",
]


def user_text(text: str, item_id: str | None = None) -> dict:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return item if item_id is None else {**item, "id": item_id}


def ga(events) -> list[str]:
    for event in events:
        check_ga_event(event.to_dict())
    return [event.wire_type for event in events]


@pytest.fixture
async def openai_session():
    h = make_harness()
    try:
        yield await h.client.open(OPENAI)
    finally:
        await h.manager.shutdown()


async def test_with_nothing_said_the_model_speaks_first(openai_session):
    await openai_session.send(
        {"type": "response.create", "response": {"output_modalities": ["audio"]}}
    )
    events = await openai_session.until("rate_limits.updated")
    assert ga(events) == WORDS_ONLY  # echo says "echo 0 ms", no audio: the turn had none
    done = events[-2].response
    assert done["status"] == "completed" and done["status_details"] is None
    assert done["output"] == [
        {
            "id": events[1].item["id"],
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_audio", "transcript": "echo 0 ms"}],
        }
    ]


async def test_user_text_items_are_answered_and_consumed(openai_session):
    session = openai_session
    await session.send({"type": "conversation.item.create", "item": user_text("hello there")})
    await session.send({"type": "conversation.item.create", "item": user_text("how are you")})
    await session.send({"type": "response.create"})
    events = await session.until("rate_limits.updated")
    kinds = ga(events)
    assert kinds[6:] == WORDS_ONLY
    said = events[-2].response["output"][0]["content"][0]["transcript"]
    assert said == "echo: hello there how are you"
    await session.send({"type": "response.create"})  # the items were answered: nothing new
    events = await session.until("rate_limits.updated")
    assert ga(events) == WORDS_ONLY
    assert events[-2].response["output"][0]["content"][0]["transcript"] == "echo 0 ms"


async def test_the_plugin_gets_a_turn_without_audio_carrying_the_text():
    parts = await make_parts(OPENAI)
    try:
        requests = recorded_requests(parts)
        await dispatch(parts.ctx, CreateItem(item=user_text("what is", "item_a")))
        spoken = {
            "type": "message",
            "role": "user",
            "id": "item_b",
            "content": [{"type": "input_audio", "transcript": " your name "}],
        }
        await dispatch(parts.ctx, CreateItem(item=spoken))
        await dispatch(parts.ctx, CreateResponse(), in_order=True)
        turn = requests[-1].turn
        assert (turn.audio.size, turn.text, turn.item_id) == (0, "what is your name", "item_b")
        assert parts.session.unanswered_items == 0
        assert conversation_turn(parts.session, 16000).text == ""  # consumed
    finally:
        await close_parts(parts)


async def test_a_call_output_is_still_answered_as_one():
    """After a function_call_output the turn is the tool's (tool_calls.py), as before."""
    parts = await make_parts(OPENAI)
    try:
        requests = recorded_requests(parts)
        call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
        await dispatch(parts.ctx, CreateItem(item=call))
        output = {"type": "function_call_output", "call_id": "call_1", "output": "ok"}
        await dispatch(parts.ctx, CreateItem(item=output))
        await dispatch(parts.ctx, CreateResponse(), in_order=True)
        assert requests[-1].turn.item_id == parts.session.conversation.items[-1]["id"]
        assert requests[-1].turn.text == "" and requests[-1].turn.audio.size == 0
    finally:
        await close_parts(parts)


async def test_the_duplex_surface_keeps_its_refusals(parts):
    with pytest.raises(DuplexSessionError) as info:
        await dispatch(parts.ctx, CreateResponse(), in_order=True)
    assert info.value.code == "response_create_without_input"
    await dispatch(parts.ctx, CreateItem(item=user_text("hi")))
    with pytest.raises(DuplexSessionError) as info:
        await dispatch(parts.ctx, CreateResponse(), in_order=True)
    assert info.value.code == "text_only_turn_unsupported"
    assert parts.session.active is None and parts.session.unanswered_items == 0
