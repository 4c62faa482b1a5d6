"""The assistant's function calling: the built-in responder's deterministic calls and
answers, the LLM prompt and the parser of calls in generated text (with a fake text
stage), and a spoken turn that calls a tool through the session engine."""

import asyncio
import json

import pytest

from harness.sessions import appends, make_harness, send_all, types
from harness.speech import spoken
from plugins.assistant import AssistantPlugin
from plugins.assistant.responder import llm_prompt, name_words, tool_answer, tool_call_for
from plugins.assistant.stage import AssistantRequest, AssistantStagePort
from plugins.assistant.tool_text import ToolCallText, parse_call
from shared.contracts import (
    DuplexFence,
    FunctionCall,
    StageOutput,
    StagePlan,
    TaskStagePort,
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME = {"type": "function", "name": "getTime"}
WEATHER_REPORT = {"type": "function", "name": "get_weather_report"}


# ---------------------------------------------------------------- the built-in responder


def test_tool_names_read_as_words():
    assert name_words("get_weather") == ["get", "weather"]
    assert name_words("getTime") == ["get", "time"]
    assert name_words("look-up_Weather2") == ["look", "up", "weather"]


@pytest.mark.parametrize(
    "heard, tools, choice, call",
    [
        ("please get the weather", [WEATHER], "auto", ("get_weather", {})),
        ("get the weather in paris", [WEATHER], "auto", ("get_weather", {"city": "paris"})),
        ("get weather for new york", [WEATHER], "auto", ("get_weather", {"city": "new york"})),
        ("what is the get weather", [WEATHER], "auto", ("get_weather", {})),
        ("weather get", [WEATHER], "auto", None),  # the name's words, not in order
        ("hello", [WEATHER], "auto", None),
        ("please get the weather", [WEATHER], "none", None),
        ("hello", [WEATHER, TIME], "required", ("get_weather", {})),  # the first tool
        ("get the time", [WEATHER, TIME], "required", ("getTime", {})),  # the named one
        ("hello", [WEATHER, TIME], {"type": "function", "name": "getTime"}, ("getTime", {})),
        ("hello", [WEATHER], {"type": "function", "name": "undeclared"}, None),
        # the most specific name wins: "report" words are all there too
        ("get the weather report", [WEATHER, WEATHER_REPORT], "auto", ("get_weather_report", {})),
        ("get the time", [TIME], "auto", ("getTime", {})),
    ],
)
def test_the_responder_calls_the_tool_the_user_names(heard, tools, choice, call):
    made = tool_call_for(heard, tools, choice)
    if call is None:
        assert made is None
    else:
        assert (made.name, json.loads(made.arguments), made.call_id) == (*call, None)


def history_with_output(output: str, name: str = "get_weather") -> list[dict]:
    call = {"type": "function_call", "call_id": "c1", "name": name, "arguments": "{}"}
    return [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
        call,
        {"type": "function_call_output", "call_id": "c1", "output": output},
    ]


@pytest.mark.parametrize(
    "output, said",
    [
        ("It is sunny in Paris.", "The get weather tool says: It is sunny in Paris."),
        ("Sunny. Warm later.", "The get weather tool says: Sunny."),
        ('"light rain"', "The get weather tool says: light rain."),
        (
            '{"forecast": "sunny", "high": 21}',
            "The get weather tool says: forecast is sunny, high is 21.",
        ),
        ("", "The get weather tool says: nothing."),
    ],
)
def test_after_an_output_the_answer_speaks_it(output, said):
    assert tool_answer(history_with_output(output)) == said


def test_no_output_no_tool_answer():
    assert tool_answer([]) is None
    assert tool_answer(history_with_output("x")[:2]) is None


#: client text nested past the JSON parser's depth (json.loads raises RecursionError)
NESTED = "[" * 100_000 + "]" * 100_000


def test_an_output_nested_too_deep_is_read_as_text():
    said = tool_answer(history_with_output(NESTED))
    assert said is not None and said.startswith("The get weather tool says: [[[")
    answer = plan(AssistantPlugin(), history=history_with_output(NESTED), tools=[WEATHER])
    assert answer.reply == said


def test_a_client_call_nested_too_deep_is_shown_as_its_text():
    history = history_with_output("Sunny.")
    history[1] = {**history[1], "arguments": NESTED}
    line = llm_prompt(history, "", "", [WEATHER], "auto").splitlines()[-3]
    assert json.loads(line.removeprefix("Assistant: <tool_call>").removesuffix("</tool_call>")) == {
        "name": "get_weather",
        "arguments": NESTED,
    }


def plan(plugin, heard="", history=(), tools=(), tool_choice="auto"):
    import numpy as np

    from shared.contracts import (
        CommittedTurn,
        DuplexSessionConfig,
        ResponseCreateOptions,
        ResponsePlanRequest,
    )

    turn = CommittedTurn(1, "item_1", np.zeros(0, np.float32), 16000, transcript=heard)
    request = ResponsePlanRequest(
        fence=DuplexFence("duplex-x", 0, 1),
        request_id="r",
        response_id="resp_1",
        turn=turn,
        config=DuplexSessionConfig(instructions="Be brief."),
        runtime_config={},
        options=ResponseCreateOptions(),
        history=list(history),
        tools=tuple(tools),
        tool_choice=tool_choice,
    )
    return plugin.plan_response(request).payload


def test_the_plan_is_a_call_an_answer_or_a_reply():
    plugin = AssistantPlugin()
    call = plan(plugin, "please get the weather", tools=[WEATHER])
    assert call.function_call == FunctionCall("get_weather", "{}") and call.reply is None
    assert plan(plugin, "hello", tools=[WEATHER]).reply == "Hello! How can I help you?"
    answer = plan(plugin, history=history_with_output("Sunny."), tools=[WEATHER])
    assert answer.reply == "The get weather tool says: Sunny." and answer.function_call is None


# ---------------------------------------------------------------- with an LLM


def test_the_llm_prompt_offers_the_tools_and_shows_calls_and_outputs():
    own = {"type": "message", "role": "assistant", "status": "in_progress", "content": []}
    history = [*history_with_output("Sunny."), own]  # the worker adds the response's item
    prompt = llm_prompt(history, "", "Be brief.", [WEATHER], "required").splitlines()
    assert prompt[:2] == ["Be brief.", "You can call these tools:"]
    assert json.loads(prompt[2]) == WEATHER
    assert prompt[3].startswith("To call one, answer with one line: <tool_call>{")
    assert prompt[4:] == [
        "You must call one of these tools.",
        "User: x",
        'Assistant: <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
        "Tool: <tool_response>Sunny.</tool_response>",
        "Assistant:",  # the answer to the output: no empty user line
    ]
    assert "You can call" not in llm_prompt([], "hi", "", [WEATHER], "none")
    forced = llm_prompt([], "hi", "", [WEATHER], {"type": "function", "name": "get_weather"})
    assert "You must call the tool get_weather." in forced


def feed_all(pieces, allowed=("get_weather",)) -> tuple[str, list[FunctionCall]]:
    parser = ToolCallText(allowed)
    speech = "".join(parser.feed(piece) for piece in pieces) + parser.finish()
    return speech, parser.calls


def test_calls_are_read_from_streamed_text():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "St. Louis"}}</tool_call>'
    text = "Let me check. " + call + " Done."
    for size in (1, 3, 7, len(text)):  # the tags split anywhere
        speech, calls = feed_all([text[i : i + size] for i in range(0, len(text), size)])
        assert speech == "Let me check. "  # nothing after the call is spoken
        assert calls == [FunctionCall("get_weather", '{"city": "St. Louis"}')]
    # a block left open when generation ends; two calls; arguments as a JSON string
    assert feed_all(['<tool_call>{"name": "get_weather", "arguments": {}}'])[1] == [
        FunctionCall("get_weather", "{}")
    ]
    second = {"name": "get_weather", "arguments": json.dumps({"city": "x"})}
    two = '<tool_call>{"name": "get_weather"}</tool_call>\n' + f"<tool_call>{json.dumps(second)}"
    assert [c.arguments for c in feed_all([two])[1]] == ["{}", '{"city": "x"}']
    assert feed_all(["a < b, and <tool but not a call."]) == (
        "a < b, and <tool but not a call.",
        [],
    )


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        '{"arguments": {}}',
        '{"name": "rm_rf", "arguments": {}}',  # not a tool this response may call
        '{"name": "get_weather", "arguments": [1]}',
    ],
)
def test_bad_calls_are_dropped(body):
    assert parse_call(body, ["get_weather"]) is None


class FakeTextStage(TaskStagePort):
    """A text stage that streams fixed pieces, then "done" with the whole text (as vLLM)."""

    def __init__(self, pieces: list[str]) -> None:
        super().__init__()
        self.pieces = pieces
        self.prompts: list[str] = []

    async def _run(self, plan: StagePlan) -> None:
        self.prompts.append(plan.payload.prompt)
        for piece in self.pieces:
            await asyncio.sleep(0)
            self._emit(StageOutput(plan.request_id, plan.fence, "text", text=piece))
        self._emit(StageOutput(plan.request_id, plan.fence, "done", text="".join(self.pieces)))


async def run_stage(port: AssistantStagePort, request: AssistantRequest) -> list[StageOutput]:
    fence = DuplexFence("duplex-tools", 0, 1)
    outputs: list[StageOutput] = []
    finished = asyncio.Event()

    def sink(output: StageOutput) -> None:
        outputs.append(output)
        if output.kind in ("done", "error"):
            finished.set()

    port.bind(fence.session_id, sink)
    request_id = await port.ensure(fence, "stage0")
    await port.submit_initial(StagePlan(request_id, fence, "stage0", request))
    await asyncio.wait_for(finished.wait(), 30)
    return outputs


def silent_port(text_stage=None) -> tuple[AssistantStagePort, list[str]]:
    said: list[str] = []

    def synthesize(text: str):
        import numpy as np

        said.append(text)
        return np.zeros(2205, np.float32)  # 100 ms

    return AssistantStagePort(synthesize, 22050, text_stage), said


async def test_a_generated_call_is_spoken_up_to_the_call_then_emitted():
    pieces = [
        "Let me ",
        "check. <tool",
        '_call>{"name": "get_weather", ',
        '"arguments": {}}</tool_call>',
    ]
    stage = FakeTextStage(pieces)
    port, said = silent_port(stage)
    request = AssistantRequest(prompt="p", pace=0, tools=("get_weather",))
    outputs = await run_stage(port, request)
    assert said == ["Let me check."]
    assert [o.kind for o in outputs] == ["audio", "function_call", "done"]
    assert outputs[1].function_call == FunctionCall("get_weather", "{}")
    assert outputs[-1].text == "Let me check."


async def test_without_tools_the_generated_text_is_spoken_once():
    port, said = silent_port(FakeTextStage(["Hello there. ", "How are you?"]))
    outputs = await run_stage(port, AssistantRequest(prompt="p", pace=0))
    assert said == ["Hello there.", "How are you?"]  # "done" repeats the text: not said again
    assert outputs[-1].kind == "done"


async def test_a_responder_call_says_nothing():
    port, said = silent_port()
    call = FunctionCall("get_weather", "{}")
    outputs = await run_stage(port, AssistantRequest(function_call=call, pace=0))
    assert said == [] and [o.kind for o in outputs] == ["function_call", "done"]


# ---------------------------------------------------------------- through the session engine

TOOL_SESSION = {
    "turn_detection": {"type": "server_vad"},
    "extra_body": {"pace": 0},
    "tools": [WEATHER],
}


async def test_a_spoken_request_calls_the_tool_and_the_output_is_spoken():
    h = make_harness(plugin=AssistantPlugin())
    try:
        session = await h.open(TOOL_SESSION)
        await send_all(session, appends(spoken("please get the weather"), 16000))
        events = await session.until("response.done")
        heard = next(
            e
            for e in events
            if e.wire_type == "conversation.item.input_audio_transcription.completed"
        )
        # Whisper: "please get to the weather" or "please get the weather" in every variant
        # measured (tests/plugins/assistant/test_whisper.py says how)
        assert "get" in heard.transcript and "weather" in heard.transcript
        done = events[-1]
        assert done.response["status"] == "completed"
        call = done.response["output"][-1]
        assert (call["type"], call["name"], call["arguments"]) == (
            "function_call",
            "get_weather",
            "{}",
        )
        assert "response.output_audio.delta" not in types(events)  # a call, no words

        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny."}
        await session.send({"type": "conversation.item.create", "item": output})
        await session.send({"type": "response.create"})
        events = await session.until("response.done")
        said = next(e for e in events if e.wire_type == "response.output_audio_transcript.done")
        assert said.transcript == "The get weather tool says: Sunny."
        assert events[-1].response["status"] == "completed"
    finally:
        await h.manager.shutdown()


def text_turn(text: str) -> list[dict]:
    return [{"type": "input.text.append", "text": text}, {"type": "input.commit"}]


async def test_an_announced_call_cancelled_while_it_speaks_leaves_nothing():
    h = make_harness(plugin=AssistantPlugin())
    try:
        announced = {"pace": 1, "announce_tool_calls": True}
        session = await h.open(
            {"turn_detection": None, "tools": [WEATHER], "extra_body": announced}
        )
        await send_all(session, text_turn("please get the weather"))
        await session.until("response.output_audio.delta")  # "Let me use the ..." is playing
        await session.send({"type": "response.cancel"})
        events = await session.until("response.done")
        assert events[-1].response["status"] == "cancelled"
        assert [item["type"] for item in events[-1].response["output"]] == ["message"]
        assert not [e for e in events if e.wire_type.startswith("response.function_call")]
        await session.send({"type": "response.create", "event_id": "again"})
        error = (await session.until("error"))[-1]
        assert (error.code, error.related_event_id) == ("response_create_without_input", "again")

        # asked again and left to finish: said, then called
        await send_all(session, text_turn("please get the weather"))
        events = await session.until("response.done")
        said = next(e for e in events if e.wire_type == "response.output_audio_transcript.done")
        assert said.transcript == "Let me use the get weather tool."
        assert events[-1].response["output"][-1]["name"] == "get_weather"
    finally:
        await h.manager.shutdown()


async def test_a_pending_call_is_answered_after_the_session_moves():
    from shared.client.inline import InlineSession

    a, b = make_harness(plugin=AssistantPlugin()), make_harness(plugin=AssistantPlugin())
    try:
        session = await a.open(
            {"turn_detection": None, "tools": [WEATHER], "extra_body": {"pace": 0}}
        )
        await send_all(session, text_turn("get the weather in paris"))
        call = (await session.until("response.done"))[-1].response["output"][-1]
        assert json.loads(call["arguments"]) == {"city": "paris"}
        data = a.manager.moves.snapshot(session.session_id)
        await b.manager.moves.restore(session.session_id, data, owner_generation=2, reason="drain")
        moved = InlineSession(b.manager, b.router, session.session_id, {})
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "Rain."}
        await moved.send({"type": "conversation.item.create", "item": output})
        await moved.send({"type": "response.create"})
        events = await moved.until("response.done")
        said = next(e for e in events if e.wire_type == "response.output_audio_transcript.done")
        assert said.transcript == "The get weather tool says: Rain."
    finally:
        await a.manager.shutdown()
        await b.manager.shutdown()
