"""Function calling through the whole server (`duplex serve --plugin assistant`, the duplex
surface): a spoken request calls a declared tool with the GA events, the client's output
is spoken in the answer, a barge-in into the answer keeps the call and its output, a call
cancelled while announced leaves nothing, a dropped socket resumes mid-exchange, bad tools
and unknown calls are refused, and the openai SDK drives the same exchange (on the openai
surface a call alone is the response's only output item, GA's way; the duplex surface keeps
contract 1.2's message item, opened with the response, so its call is at output_index 1)."""

import asyncio
import base64
import json

import pytest

from harness.processes import start_serve
from harness.speech import ASSISTANT_SESSION, say, spoken
from shared.client.duplex_client import DuplexClient
from shared.protocol.duplex import float_to_pcm16

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather where the user is.",
    "parameters": {"type": "object", "properties": {}},
}
#: one function_call output item's events, in the GA order (+ the beta `.created`)
CALL_EVENTS = [
    "response.output_item.added",
    "conversation.item.added",
    "conversation.item.created",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]


@pytest.fixture(scope="module")
def assistant():
    process = start_serve("serve-tools", ("--plugin", "assistant"))
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


async def connect(server, **session) -> DuplexClient:
    return await DuplexClient(server.base, heartbeat_s=None).connect(
        {"turn_detection": None, "tools": [WEATHER], "extra_body": {"pace": 0}, **session}
    )


async def text_turn(client: DuplexClient, text: str) -> None:
    await client.send({"type": "input.text.append", "text": text})
    await client.send({"type": "input.commit"})


def of_type(events, wire_type: str):
    return [event for event in events if event.wire_type == wire_type]


async def answer(client: DuplexClient, call_id: str, output: str) -> None:
    item = {"type": "function_call_output", "call_id": call_id, "output": output}
    await client.send({"type": "conversation.item.create", "item": item})
    await client.send({"type": "response.create"})


async def test_a_spoken_request_calls_the_tool_and_the_answer_speaks_its_output(assistant):
    session = {**ASSISTANT_SESSION, "tools": [WEATHER]}
    client = await DuplexClient(assistant.base, heartbeat_s=None).connect(session)
    try:
        await say(client, spoken("can you get the weather for me"))
        events = await client.until("response.done", timeout=30)
        heard = of_type(events, "conversation.item.input_audio_transcription.completed")[-1]
        assert "get" in heard.transcript and "weather" in heard.transcript
        at = next(
            i
            for i, e in enumerate(events)
            if e.wire_type == "response.output_item.added" and e.item["type"] == "function_call"
        )
        assert [e.wire_type for e in events[at:]] == CALL_EVENTS
        call_added, _, _, delta, args_done, item_done, _, done = events[at:]
        call = item_done.item
        assert call_added.output_index == 1 and call_added.item["status"] == "in_progress"
        assert (call["type"], call["name"], call["arguments"], call["status"]) == (
            "function_call",
            "get_weather",
            "{}",
            "completed",
        )
        assert delta.call_id == args_done.call_id == call["call_id"] and delta.delta == "{}"
        assert (args_done.name, args_done.arguments, args_done.item_id) == (
            "get_weather",
            "{}",
            call["id"],
        )
        assert done.response["status"] == "completed" and done.response["output"][-1] == call
        assert not of_type(events, "response.output_audio.delta")  # a call says nothing

        await answer(client, call["call_id"], "It is sunny in Paris.")
        events = await client.until("response.output_audio.delta", timeout=30)
        output_item = of_type(events, "conversation.item.added")[0].item
        assert output_item["type"] == "function_call_output"
        response_id = events[-1].response_id

        # the user talks over the answer: it is cancelled, the call and its output stay
        speaking = asyncio.create_task(say(client, spoken("thank you", lead_s=0.1)))
        events = await client.until("response.done", timeout=30)
        await speaking
        assert events[-1].response_id == response_id
        assert events[-1].response["status"] == "cancelled"
        assert events[-1].response["status_details"]["reason"] == "barge_in"
        for item_id in (call["id"], output_item["id"]):
            await client.send({"type": "conversation.item.retrieve", "item_id": item_id})
            retrieved = (await client.until("conversation.item.retrieved"))[-1]
            assert retrieved.item["id"] == item_id
    finally:
        await client.close()


async def test_the_answer_uses_the_output(assistant):
    client = await connect(assistant)
    try:
        await text_turn(client, "please get the weather")
        call = (await client.until("response.done"))[-1].response["output"][-1]
        await answer(client, call["call_id"], '{"forecast": "sunny", "high": 21}')
        events = await client.until("response.done")
        said = of_type(events, "response.output_audio_transcript.done")[-1].transcript
        assert said == "The get weather tool says: forecast is sunny, high is 21."
        assert events[-1].response["status"] == "completed"
    finally:
        await client.close()


async def test_a_call_cancelled_while_it_is_announced_leaves_no_call(assistant):
    client = await connect(assistant, extra_body={"pace": 1, "announce_tool_calls": True})
    try:
        await text_turn(client, "please get the weather")
        await client.until("response.output_audio.delta")  # the announcement is playing
        await client.send({"type": "response.cancel"})
        events = await client.until("response.done")
        assert events[-1].response["status"] == "cancelled"
        assert [item["type"] for item in events[-1].response["output"]] == ["message"]
        assert not [e for e in events if e.wire_type.startswith("response.function_call")]
        await client.send({"type": "response.create", "event_id": "nothing-to-answer"})
        error = (await client.until("error"))[-1]
        assert error.code == "response_create_without_input"
        assert error.related_event_id == "nothing-to-answer"
    finally:
        await client.close()


async def test_bad_tools_and_unknown_calls_are_refused(assistant):
    client = await connect(assistant)
    try:
        refusals = [
            (
                {"type": "session.update", "session": {"tools": [{"type": "function"}]}},
                "invalid_tools",
            ),
            ({"type": "session.update", "session": {"tool_choice": "maybe"}}, "invalid_tools"),
            ({"type": "response.create", "response": {"tools": "all"}}, "invalid_tools"),
            (
                {
                    "type": "conversation.item.create",
                    "item": {"type": "function_call_output", "call_id": "call_x", "output": "x"},
                },
                "unknown_function_call",
            ),
            (
                {
                    "type": "conversation.item.create",
                    "item": {"type": "function_call_output", "call_id": "call_x"},
                },
                "invalid_function_call_output",
            ),
        ]
        for index, (command, code) in enumerate(refusals):
            # raw frames: the client's own codec would refuse some before sending
            await client._ws.send(json.dumps({**command, "event_id": f"bad-{index}"}))
            error = (await client.until("error"))[-1]
            assert (error.code, error.related_event_id) == (code, f"bad-{index}")

        await text_turn(client, "please get the weather")
        call = (await client.until("response.done"))[-1].response["output"][-1]
        await answer(client, call["call_id"], "Sunny.")
        await client.until("response.done")
        item = {"type": "function_call_output", "call_id": call["call_id"], "output": "again"}
        await client.send({"type": "conversation.item.create", "item": item, "event_id": "dup"})
        error = (await client.until("error"))[-1]
        assert (error.code, error.related_event_id) == ("duplicate_function_output", "dup")
    finally:
        await client.close()


async def test_a_dropped_socket_resumes_between_the_call_and_its_output(assistant):
    client = await connect(assistant)
    try:
        await text_turn(client, "please get the weather")
        call = (await client.until("response.done"))[-1].response["output"][-1]
        await client.drop_connection()
        await answer(client, call["call_id"], "Cloudy.")  # sent once resumed
        events = await client.until("response.done", timeout=30)
        assert client.resumes == 1
        said = of_type(events, "response.output_audio_transcript.done")[-1].transcript
        assert said == "The get weather tool says: Cloudy."
        assert client.wire_seqs == list(range(1, client.last_seq + 1))
    finally:
        await client.close()


async def test_the_openai_sdk_calls_a_tool_and_answers_it(assistant):
    from openai import AsyncOpenAI

    sdk = AsyncOpenAI(api_key="unused", base_url=f"{assistant.base}/v1")
    pcm = float_to_pcm16(spoken("can you get the weather for me"))
    async with sdk.realtime.connect(model="assistant") as connection:
        await connection.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": 16000},
                        "turn_detection": None,
                    }
                },
                "tools": [WEATHER],
                "tool_choice": "auto",
            }
        )
        for start in range(0, len(pcm), 640):
            await connection.input_audio_buffer.append(
                audio=base64.b64encode(pcm[start : start + 640]).decode()
            )
        await connection.input_audio_buffer.commit()
        await connection.response.create()
        kinds, done, added = [], None, []
        async for event in connection:
            kinds.append(event.type)
            assert event.type != "error", event.error
            if event.type == "response.output_item.added":
                added.append(event)
            if event.type == "response.function_call_arguments.done":
                done = event
            if event.type == "response.done":
                assert event.response.status == "completed"
                # GA: a response that says nothing outputs just its call, at index 0
                assert [item.type for item in event.response.output] == ["function_call"]
                break
        assert done is not None and done.name == "get_weather" and done.arguments == "{}"
        assert [(e.item.type, e.output_index) for e in added] == [("function_call", 0)]
        assert done.output_index == 0
        assert kinds.index("response.function_call_arguments.delta") < kinds.index(
            "response.function_call_arguments.done"
        )

        await connection.conversation.item.create(
            item={"type": "function_call_output", "call_id": done.call_id, "output": "Snow."}
        )
        await connection.response.create()
        transcript = None
        async for event in connection:
            assert event.type != "error", event.error
            if event.type == "response.output_audio_transcript.done":
                transcript = event.transcript
            if event.type == "response.done":
                assert event.response.status == "completed"
                break
        assert transcript == "The get weather tool says: Snow."
