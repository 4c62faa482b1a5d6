"""What the plugins make of the GA responses (issue 17): a turn without audio (the client's
text items, or nothing: the model speaks first), a text response (not synthesized), and
max_output_tokens (the assistant's LLM gets it as its own limit)."""

import numpy as np
import pytest

from plugins.assistant import AssistantPlugin
from plugins.assistant.responder import GREETING, NAME, SORRY, llm_prompt
from plugins.assistant.stage import AssistantRequest
from plugins.echo import EchoPlugin, EchoStagePort
from plugins.echo.plugin import ECHO_TEXT_CHARS, echo_transcript
from shared.contracts import (
    CommittedTurn,
    DuplexFence,
    DuplexSessionConfig,
    ResponseCreateOptions,
    ResponsePlanRequest,
)
from tests.plugins.assistant.test_assistant_tools import (
    WEATHER,
    FakeTextStage,
    run_stage,
    silent_port,
)


def request(
    text: str = "",
    transcript: str | None = None,
    seconds: float = 0.0,
    options: dict | None = None,
    session: dict | None = None,
    history: list | None = None,
    tools: tuple = (),
) -> ResponsePlanRequest:
    audio = np.zeros(int(16000 * seconds), np.float32)
    turn = CommittedTurn(1, "item_1", audio, 16000, text, transcript)
    return ResponsePlanRequest(
        fence=DuplexFence("duplex-x", 0, 1),
        request_id="r",
        response_id="resp_1",
        turn=turn,
        config=DuplexSessionConfig.from_realtime(session or {}),
        runtime_config={"pace": 0.0},
        options=ResponseCreateOptions.from_realtime(options or {}),
        history=history or [],
        tools=tools,
    )


def user_item(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


@pytest.mark.parametrize(
    "audio_ms, has_audio, text, said",
    [
        (500, True, "", "echo 500 ms"),
        (500, True, "hi", "echo 500 ms"),  # a spoken turn is echoed by its length
        (0, False, "", "echo 0 ms"),
        (0, False, "  hello \n there ", "echo: hello there"),
    ],
)
def test_what_echo_says(audio_ms, has_audio, text, said):
    assert echo_transcript(audio_ms, has_audio, text) == said


def test_echo_cuts_a_long_text_at_a_word():
    said = echo_transcript(0, False, "word " * 100)
    assert said.startswith("echo: word word") and said.endswith(" ...")
    assert len(said) <= len("echo: ") + ECHO_TEXT_CHARS + len(" ...")


async def test_echo_answers_a_text_response_with_words_and_never_resamples():
    plan = EchoPlugin().plan_response(request(seconds=0.5, options={"output_modalities": ["text"]}))
    assert plan.payload.speak is False
    outputs = await run_stage(EchoStagePort(), plan.payload)
    assert [(o.kind, o.text, o.audio) for o in outputs] == [
        ("text", "echo 500 ms", None),
        ("done", "echo 500 ms", None),
    ]


async def test_echo_answers_a_turn_without_audio_with_words_only():
    plan = EchoPlugin().plan_response(request(text="hello"))
    assert plan.payload.speak is True  # an audio response, but nothing to play
    outputs = await run_stage(EchoStagePort(), plan.payload)
    assert [(o.kind, o.text) for o in outputs] == [("text", "echo: hello"), ("done", "echo: hello")]


def test_the_assistant_greets_answers_text_and_is_sorry_for_silence():
    plugin = AssistantPlugin()
    assert plugin.plan_response(request()).payload.reply == GREETING  # nothing at all
    named = request(text="what is your name", history=[user_item("what is your name")])
    assert plugin.plan_response(named).payload.reply == f"I am {NAME}."
    silence = request(transcript="", seconds=1.0)  # spoken, nothing heard
    assert plugin.plan_response(silence).payload.reply == SORRY


async def test_the_assistant_writes_a_text_response_without_synthesis():
    plugin = AssistantPlugin()
    text = {"output_modalities": ["text"]}
    payload = plugin.plan_response(request(text="hello", options=text)).payload
    assert payload.speak is False and payload.reply == GREETING
    port, said = silent_port()
    outputs = await run_stage(port, AssistantRequest(reply="One. Two!", pace=1, speak=False))
    assert said == []  # nothing synthesized
    assert [(o.kind, o.text) for o in outputs] == [
        ("text", "One."),
        ("text", " Two!"),
        ("done", "One. Two!"),
    ]


async def test_a_generated_text_response_is_not_synthesized():
    port, said = silent_port(FakeTextStage(["Hello there. ", "How are you?"]))
    outputs = await run_stage(port, AssistantRequest(prompt="p", pace=0, speak=False))
    assert said == [] and "".join(o.text for o in outputs if o.kind == "text") == (
        "Hello there. How are you?"
    )


def test_the_llm_gets_max_output_tokens_as_its_own_limit():
    plugin = AssistantPlugin(text_stage=object())  # plan_response only plans
    assert plugin.plan_response(request(text="hi")).payload.sampling["max_tokens"] == 64
    limited = request(text="hi", session={"max_output_tokens": 12})
    assert plugin.plan_response(limited).payload.sampling["max_tokens"] == 12
    # the response's own limit wins over the session's, and over the room a tool call needs
    options = {"max_output_tokens": 20}
    tooled = request(text="hi", session={"max_output_tokens": 12}, options=options)
    tooled.tools = (WEATHER,)
    assert plugin.plan_response(tooled).payload.sampling["max_tokens"] == 20
    unlimited = request(
        text="hi", session={"max_output_tokens": 12}, options={"max_output_tokens": "inf"}
    )
    assert plugin.plan_response(unlimited).payload.sampling["max_tokens"] == 64


def test_the_llm_prompt_of_a_turn_without_audio_adds_no_user_line():
    history = [user_item("hello"), user_item("what is your name")]
    prompt = llm_prompt(history, "hello what is your name", "Be brief.", user_turn=False)
    assert prompt.splitlines() == [
        "Be brief.",
        "User: hello",
        "User: what is your name",
        "Assistant:",
    ]
    assert llm_prompt([], "", "Be brief.", user_turn=False).splitlines() == [
        "Be brief.",
        "Assistant:",  # the assistant speaks first
    ]
    plugin = AssistantPlugin(text_stage=object())
    assert plugin.plan_response(request()).payload.prompt.splitlines()[-1] == "Assistant:"
