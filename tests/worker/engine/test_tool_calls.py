"""Function calling in the worker: a stage's call becomes a function_call output item in the
GA event order (on the openai surface the only output item of a response that said
nothing), the client's output answers it once, response.create after it plans a response
without a new turn, a cancelled or failed response leaves no call behind, tools reach the
plugin, bad tools are refused, and pending calls survive a checkpoint."""

import orjson
import pytest

from harness.sessions import make_harness, types
from services.worker.engine import surface
from services.worker.engine.checkpoint import export_checkpoint
from services.worker.engine.handlers import dispatch
from services.worker.engine.tool_calls import check_item
from shared.contracts import DuplexSessionError, FunctionCall, ResponseCreateOptions
from shared.contracts.tools import (
    MAX_DESCRIPTION_CHARS,
    MAX_PARAMETERS_BYTES,
    MAX_TOOLS,
    callable_tools,
    read_tool_choice,
    read_tools,
)
from shared.protocol.duplex import (
    CreateItem,
    CreateResponse,
    RealtimeProtocolError,
    UpdateSession,
    parse_client_event,
)
from tests.protocol.ga_events import check_ga_event
from tests.worker.engine.test_checkpoint import reimport
from tests.worker.engine.test_echo_turn import RESPONSE_END
from tests.worker.session_parts import close_parts, make_parts

OPENAI = {"duplex_surface": "openai", "turn_detection": None, "extra_body": {"pace": 0}}

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
#: a call item's events, in the GA order (plus the beta `conversation.item.created`)
CALL_EVENTS = [
    "response.output_item.added",
    "conversation.item.added",
    "conversation.item.created",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "conversation.item.done",
]
#: a response that said nothing and called a tool (the duplex surface): its message item,
#: opened with the response, closes empty, then the call
# a response that only calls a tool: its audio part (opened with it) closes unused
CALL_RESPONSE_END = [
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    *CALL_EVENTS,
    "response.done",
    "rate_limits.updated",
]


async def refused(coro) -> str:
    with pytest.raises(DuplexSessionError) as info:
        await coro
    return info.value.code


def recorded_requests(parts) -> list:
    """Every ResponsePlanRequest the plugin is asked to plan, from now on."""
    requests, plan = [], parts.responses.plugin.plan_response

    def recording(request):
        requests.append(request)
        return plan(request)

    parts.responses.plugin.plan_response = recording
    return requests


async def call_weather(parts, arguments='{"city": "paris"}', call_id=None) -> dict:
    """A response that calls get_weather and completes; returns the call item."""
    await parts.start_response()
    parts.take_events()
    call = FunctionCall("get_weather", arguments, call_id)
    await parts.apply(parts.output("function_call", function_call=call))
    assert parts.take_events() == []  # held until the response completes
    await parts.apply(parts.output("done"))
    events = parts.take_events()
    assert types(events) == CALL_RESPONSE_END
    return events[-3].item


def output_item(call_id: str, output: str = "It is sunny.") -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


async def test_a_call_is_emitted_in_ga_order_when_its_response_completes(parts):
    await parts.start_response()
    response = parts.session.active
    parts.take_events()
    await parts.apply(parts.output("audio", 0.1, text="Let me see."))
    call = FunctionCall("get_weather", '{"city": "paris"}', "call_fixed")
    await parts.apply(parts.output("function_call", function_call=call))
    await parts.apply(parts.output("done"))
    events = parts.take_events()
    # the message item's audio closes first, then the call item at output_index 1
    # (the audio part opened with the response, on the duplex surface)
    assert types(events) == [
        "response.speak",
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        *RESPONSE_END[:5],
        *CALL_EVENTS,
        *RESPONSE_END[5:],
    ]
    added, conv_added, _, delta, args_done, item_done, conv_done, done = events[8:16]
    item_id = item_done.item["id"]
    assert added.output_index == delta.output_index == args_done.output_index == 1
    assert added.item == {
        "id": item_id,
        "object": "realtime.item",
        "type": "function_call",
        "status": "in_progress",
        "call_id": "call_fixed",
        "name": "get_weather",
        "arguments": "",
    }
    assert conv_added.previous_item_id == response.item_id and conv_added.item == added.item
    assert (delta.call_id, delta.item_id, delta.delta) == ("call_fixed", item_id, call.arguments)
    assert (args_done.name, args_done.arguments, args_done.response_id) == (
        "get_weather",
        '{"city": "paris"}',
        response.response_id,
    )
    assert item_done.item == {**added.item, "status": "completed", "arguments": call.arguments}
    assert conv_done.item == item_done.item
    assert done.response["status"] == "completed"
    assert [item["type"] for item in done.response["output"]] == ["message", "function_call"]
    assert done.response["output"][1] == item_done.item
    history = parts.session.conversation
    assert history.items[-1] == item_done.item and history.items[-2]["id"] == response.item_id
    assert history.pending_call_ids() == ["call_fixed"]


async def test_the_output_answers_a_known_call_once(parts):
    call = await call_weather(parts)
    assert call["call_id"].startswith("call_")  # the worker made it: the stage gave none
    unknown = CreateItem(item=output_item("call_nope"))
    assert await refused(dispatch(parts.ctx, unknown)) == "unknown_function_call"
    await dispatch(parts.ctx, CreateItem(item=output_item(call["call_id"])))
    events = parts.take_events()
    assert types(events) == [
        "conversation.item.added",
        "conversation.item.created",
        "conversation.item.done",
    ]
    assert events[0].previous_item_id == call["id"]
    assert events[0].item["type"] == "function_call_output"
    assert parts.session.conversation.pending_call_ids() == []
    again = CreateItem(item=output_item(call["call_id"], "again"))
    assert await refused(dispatch(parts.ctx, again)) == "duplicate_function_output"
    reused = {"type": "function_call", "call_id": call["call_id"], "name": "x", "arguments": ""}
    assert await refused(dispatch(parts.ctx, CreateItem(item=reused))) == "bad_event"


def test_a_malformed_output_is_refused_by_the_codec():
    for item in (
        {"type": "function_call_output", "output": "x"},
        {"type": "function_call_output", "call_id": "c", "output": 3},
    ):
        with pytest.raises(RealtimeProtocolError) as info:
            parse_client_event({"type": "conversation.item.create", "item": item})
        assert info.value.code == "invalid_function_call_output"


async def test_response_create_after_the_output_answers_it_without_a_turn(parts):
    requests = recorded_requests(parts)
    refusal = dispatch(parts.ctx, CreateResponse(), in_order=True)
    assert await refused(refusal) == "response_create_without_input"
    call = await call_weather(parts)
    refusal = dispatch(parts.ctx, CreateResponse(), in_order=True)
    assert await refused(refusal) == "response_create_without_input"  # not answered yet
    await dispatch(parts.ctx, CreateItem(item=output_item(call["call_id"])))
    parts.take_events()
    await dispatch(parts.ctx, CreateResponse(), in_order=True)
    assert types(parts.take_events())[0] == "response.created"
    request = requests[-1]
    assert request.turn.audio.size == 0 and request.turn.text == ""
    assert [item["type"] for item in request.history][-3:] == [
        "function_call",
        "function_call_output",
        "message",  # the new response's own item
    ]


async def test_a_cancelled_response_leaves_no_call_behind(parts):
    await parts.start_response()
    call = FunctionCall("get_weather", "{}", "call_cancelled")
    await parts.apply(parts.output("function_call", function_call=call))
    parts.take_events()
    await parts.responses.advance_epoch("client_cancelled")
    events = parts.take_events()
    assert "response.function_call_arguments.done" not in types(events)
    assert events[-2].response["status"] == "cancelled"
    assert [item["type"] for item in events[-2].response["output"]] == ["message"]
    conversation = parts.session.conversation
    assert all(item["type"] != "function_call" for item in conversation.items)
    assert conversation.pending_call_ids() == []
    answer = CreateItem(item=output_item("call_cancelled"))
    assert await refused(dispatch(parts.ctx, answer)) == "unknown_function_call"


async def test_a_failed_response_leaves_no_call_behind(parts):
    await parts.start_response()
    parts.take_events()
    call = FunctionCall("get_weather", "{}", "call_failed")
    await parts.apply(parts.output("function_call", function_call=call))
    await parts.apply(parts.output("error", error_code="runtime_data_plane_stream_failed"))
    events = parts.take_events()
    assert "response.function_call_arguments.done" not in types(events)
    assert [item["type"] for item in events[-3].response["output"]] == ["message"]
    assert parts.session.conversation.items == []


async def test_tools_reach_the_plugin_from_the_session_or_the_response(parts):
    requests = recorded_requests(parts)
    session = {"tools": [WEATHER], "tool_choice": "required"}
    await dispatch(parts.ctx, UpdateSession(patch=session))
    await parts.start_response()
    assert requests[-1].tools == (WEATHER,) and requests[-1].tool_choice == "required"

    other = {"type": "function", "name": "get_time"}
    forced = {"type": "function", "name": "get_time"}
    for options, tools, choice in (
        ({"tools": [other], "tool_choice": forced}, (other,), forced),
        ({"tools": []}, (), "required"),  # no tools for this response; the session's choice
        ({}, (WEATHER,), "required"),
    ):
        create = ResponseCreateOptions.from_realtime(options)
        await parts.responses.start_response(requests[-1].turn, create, None)
        assert (requests[-1].tools, requests[-1].tool_choice) == (tools, choice)


async def test_bad_tools_are_refused_with_invalid_tools(parts):
    for session in (
        {"tools": {"name": "x"}},
        {"tools": [{"type": "mcp", "server_label": "x"}]},
        {"tools": [{"type": "function"}]},
        {"tools": [{"type": "function", "name": "has space"}]},
        {"tools": [{"type": "function", "name": "x", "parameters": "object"}]},
        {"tools": [{"name": "x"}, {"name": "x"}]},
        {"tools": [{"name": f"tool_{i}"} for i in range(MAX_TOOLS + 1)]},
        {"tool_choice": "sometimes"},
    ):
        assert await refused(dispatch(parts.ctx, UpdateSession(patch=session))) == "invalid_tools"
    assert parts.session.config.extra_body.get("realtime_tools") is None  # nothing applied
    bad = CreateResponse(options={"tools": [{"type": "function", "name": 7}]})
    assert await refused(dispatch(parts.ctx, bad, in_order=True)) == "invalid_tools"
    assert parts.take_events() == []


async def test_a_session_opened_with_bad_tools_is_refused():
    h = make_harness()
    try:
        with pytest.raises(DuplexSessionError) as info:
            await h.open({"tools": [{"type": "function", "name": ""}]})
        assert info.value.code == "invalid_tools"
    finally:
        await h.manager.shutdown()


def test_tool_declarations_read_as_the_ga_shape():
    assert read_tools([{"name": "a_b", "parameters": {}}]) == (
        {"type": "function", "name": "a_b", "parameters": {}},
    )
    assert read_tools(None) == () and read_tool_choice(None) == "auto"
    assert read_tool_choice({"type": "function", "name": "a", "x": 1}) == {
        "type": "function",
        "name": "a",
    }
    tools = read_tools([{"name": "a"}, {"name": "b"}])
    assert callable_tools(tools, "none") == ()
    assert [t["name"] for t in callable_tools(tools, {"type": "function", "name": "b"})] == ["b"]
    assert callable_tools(tools, {"type": "function", "name": "c"}) == ()
    assert callable_tools(tools, "auto") == tools


def limit_refused(tools) -> str | None:
    with pytest.raises(DuplexSessionError) as info:
        read_tools(tools)
    assert info.value.code == "invalid_tools"
    return info.value.param


def test_tool_declarations_are_bounded():
    many = [{"name": f"tool_{i}"} for i in range(MAX_TOOLS + 1)]
    assert len(read_tools(many[:MAX_TOOLS])) == MAX_TOOLS  # 128 distinct tools are served
    assert limit_refused(many) == "tools"
    long = "x" * MAX_DESCRIPTION_CHARS
    assert read_tools([{"name": "a", "description": long}])[0]["description"] == long
    assert limit_refused([{"name": "a", "description": long + "x"}]) == "tools[0].description"
    fits = {"type": "object", "description": "x" * (MAX_PARAMETERS_BYTES - 100)}
    assert read_tools([{"name": "a", "parameters": fits}])[0]["parameters"] == fits
    big = {"type": "object", "description": "x" * MAX_PARAMETERS_BYTES}
    assert limit_refused([{"name": "a"}, {"name": "b", "parameters": big}]) == "tools[1].parameters"
    deep: dict = {}
    for _ in range(300):  # nested past what serializes: not a schema to offer a model
        deep = {"items": deep}
    assert limit_refused([{"name": "a", "parameters": deep}]) == "tools[0].parameters"


async def test_pending_calls_survive_a_checkpoint(parts):
    answered = await call_weather(parts, call_id="call_answered")
    await dispatch(parts.ctx, CreateItem(item=output_item(answered["call_id"])))
    pending = await call_weather(parts, call_id="call_pending")
    data = export_checkpoint(parts.session, applied=(0, 0))
    items = orjson.loads(data)["items"]
    assert [item["type"] for item in items if item["type"] != "message"] == [
        "function_call",
        "function_call_output",
        "function_call",
    ]
    restored = reimport(data)
    assert restored.conversation.pending_call_ids() == [pending["call_id"]]
    check_item(restored.conversation, output_item(pending["call_id"]))  # accepted
    with pytest.raises(DuplexSessionError) as info:
        check_item(restored.conversation, output_item(answered["call_id"]))
    assert info.value.code == "duplicate_function_output"


async def test_echo_ignores_tools_and_answers_an_output_with_silence(harness):
    """A client may put its own function_call in history; echo has nothing to say to it."""
    session = await harness.open({"tools": [WEATHER], "extra_body": {"pace": 0}})
    call = {"type": "function_call", "call_id": "call_mine", "name": "get_weather"}
    await session.send({"type": "conversation.item.create", "item": {**call, "arguments": "{}"}})
    await session.send({"type": "conversation.item.create", "item": output_item("call_mine")})
    await session.send({"type": "response.create"})
    events = await session.until("response.done")
    assert events[-1].response["status"] == "completed"
    assert events[-1].response["output"][0]["content"][0]["transcript"] == "echo 0 ms"


def projected(events, session) -> list:
    """The events as the openai surface sends them, each checked against GA's types."""
    sent = [e for e in (surface.project(event, session) for event in events) if e is not None]
    for event in sent:
        check_ga_event(event.to_dict())
    return sent


async def test_on_the_openai_surface_a_call_alone_is_the_only_output_item():
    """GA: a response that says nothing outputs just its function_call item, at index 0;
    history holds no empty assistant message (the duplex surface keeps contract 1.2's
    message item, opened with the response: the tests above)."""
    parts = await make_parts(OPENAI)
    try:
        await parts.start_response()
        call = FunctionCall("get_weather", '{"city": "paris"}', "call_only")
        await parts.apply(parts.output("function_call", function_call=call))
        await parts.apply(parts.output("done"))
        events = projected(parts.take_events(), parts.session)
        assert types(events) == [
            "response.created",
            *CALL_EVENTS,
            "response.done",
            "rate_limits.updated",
        ]
        added, item_done, done = events[1], events[6], events[-2]
        assert added.output_index == events[4].output_index == 0
        assert added.item["type"] == "function_call" and events[2].previous_item_id is None
        assert done.response["output"] == [item_done.item]
        history = parts.session.conversation.items
        assert [item["type"] for item in history] == ["function_call"]
        assert parts.session.conversation.pending_call_ids() == ["call_only"]
    finally:
        await close_parts(parts)


async def test_on_the_openai_surface_a_call_after_words_follows_the_message():
    parts = await make_parts(OPENAI)
    try:
        await parts.start_response()
        response = parts.session.active
        parts.take_events()
        await parts.apply(parts.output("audio", 0.1, text="Let me see."))
        call = FunctionCall("get_weather", "{}", "call_after")
        await parts.apply(parts.output("function_call", function_call=call))
        await parts.apply(parts.output("done"))
        events = projected(parts.take_events(), parts.session)
        assert (
            types(events)
            == [
                "response.output_item.added",  # the message item, announced at its first audio
                "conversation.item.added",
                "conversation.item.created",
                "response.content_part.added",
                "response.output_audio.delta",
                "response.output_audio_transcript.delta",
                *RESPONSE_END[:5],
                *CALL_EVENTS,
                *RESPONSE_END[5:],
            ]
        )
        assert (events[0].output_index, events[11].output_index) == (0, 1)
        output = events[-2].response["output"]
        assert [item["type"] for item in output] == ["message", "function_call"]
        history = parts.session.conversation.items
        assert [item["id"] for item in history] == [response.item_id, output[1]["id"]]
    finally:
        await close_parts(parts)
