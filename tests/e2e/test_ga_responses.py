"""GA's responses through real processes (`duplex serve --plugin assistant`) and the official
`openai` SDK on plain /v1/realtime, every event validated strictly against the SDK's types
(tests/protocol/ga_events.py): the model speaks first when asked with no input, a user text
item is answered, a text-only response, a response cut at max_output_tokens, and GA's
error codes for a cancel with nothing active and a second create."""

import pytest
from openai import AsyncOpenAI

from harness.processes import start_serve
from plugins.assistant.responder import GREETING, NAME
from tests.protocol.ga_events import receive_until

#: a bound on each wait, so a missing event fails the test instead of hanging it
WAIT_S = 30


@pytest.fixture(scope="module")
def assistant():
    process = start_serve("serve-ga-responses", ("--plugin", "assistant"))
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture
def sdk(assistant):
    return AsyncOpenAI(api_key="unused", base_url=f"{assistant.base}/v1")


async def until(connection, wire_type: str, seen: list[dict]) -> dict:
    return await receive_until(connection, wire_type, seen, WAIT_S)


async def manual(connection, seen: list[dict], pace: float = 0, **session) -> None:
    """Turn detection off (the client asks for every response), the assistant's pace."""
    await until(connection, "session.created", seen)
    update = {
        "type": "realtime",
        "audio": {"input": {"turn_detection": None}},
        "extra_body": {"pace": pace},
        **session,
    }
    await connection.send({"type": "session.update", "session": update})
    await until(connection, "session.updated", seen)


def types(events: list[dict]) -> list[str]:
    return [event["type"] for event in events]


async def test_with_no_input_the_assistant_greets_first(sdk):
    seen: list[dict] = []
    async with sdk.realtime.connect(model="assistant") as connection:
        await manual(connection, seen)
        # Pipecat's canonical start: response.create before the user said anything
        await connection.response.create(response={"output_modalities": ["audio"]})
        done = await until(connection, "response.done", seen)
    response = done["response"]
    assert response["status"] == "completed" and response["output_modalities"] == ["audio"]
    (item,) = response["output"]
    assert item["content"] == [{"type": "output_audio", "transcript": GREETING}]
    kinds = types(seen)
    assert "error" not in kinds and kinds.count("response.output_audio.delta") > 0
    assert kinds.index("response.output_item.added") < kinds.index("conversation.item.added")


async def test_a_user_text_item_is_answered(sdk):
    seen: list[dict] = []
    async with sdk.realtime.connect(model="assistant") as connection:
        await manual(connection, seen)
        text = {"type": "input_text", "text": "what is your name"}
        await connection.conversation.item.create(
            item={"type": "message", "role": "user", "content": [text]}
        )
        await until(connection, "conversation.item.done", seen)
        await connection.response.create()
        done = await until(connection, "response.done", seen)
    transcript = next(e for e in seen if e["type"] == "response.output_audio_transcript.done")
    assert transcript["transcript"] == f"I am {NAME}."
    assert done["response"]["status"] == "completed" and "error" not in types(seen)


async def test_a_text_only_session_answers_in_text(sdk):
    seen: list[dict] = []
    async with sdk.realtime.connect(model="assistant") as connection:
        await manual(connection, seen, output_modalities=["text"])
        assert seen[-1]["session"]["output_modalities"] == ["text"]
        text = {"type": "input_text", "text": "hello"}
        await connection.conversation.item.create(
            item={"type": "message", "role": "user", "content": [text]}
        )
        await connection.response.create()
        done = await until(connection, "response.done", seen)
    at = types(seen).index("response.created")
    response_events = types(seen)[at:]
    assert response_events[:5] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "conversation.item.created",
        "response.content_part.added",
    ]
    assert response_events[-5:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert not [kind for kind in response_events if kind.startswith("response.output_audio")]
    deltas = [e["delta"] for e in seen[at:] if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == GREETING
    assert done["response"]["output_modalities"] == ["text"]
    assert done["response"]["output"][0]["content"] == [{"type": "output_text", "text": GREETING}]


async def test_max_output_tokens_ends_the_response_incomplete(sdk):
    seen: list[dict] = []
    async with sdk.realtime.connect(model="assistant") as connection:
        await manual(connection, seen)
        # "Hello! How can I help you?": Hello! (2 tokens) How (1), then the limit
        await connection.response.create(response={"max_output_tokens": 3})
        done = await until(connection, "response.done", seen)
    response = done["response"]
    assert response["status"] == "incomplete"
    assert response["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert response["max_output_tokens"] == 3
    (item,) = response["output"]
    assert item["status"] == "incomplete"
    assert item["content"] == [{"type": "output_audio", "transcript": "Hello! How"}]


async def test_ga_error_codes_for_a_cancel_and_a_second_create(sdk):
    seen: list[dict] = []
    async with sdk.realtime.connect(model="assistant") as connection:
        await manual(connection, seen, pace=0.1)  # a slow greeting: it stays active
        await connection.response.cancel()  # Pipecat does this on every start of speech
        error = (await until(connection, "error", seen))["error"]
        assert (error["type"], error["code"], error["message"]) == (
            "invalid_request_error",
            "response_cancel_not_active",
            "Cancellation failed: no active response found",
        )
        await connection.response.create()
        created = await until(connection, "response.created", seen)
        await connection.send({"type": "response.create", "event_id": "second"})
        error = (await until(connection, "error", seen))["error"]
        assert (error["code"], error["event_id"]) == (
            "conversation_already_has_active_response",
            "second",
        )
        await connection.response.cancel()
        done = await until(connection, "response.done", seen)
    assert done["response"]["id"] == created["response"]["id"]
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
