"""Nemotron's tool-call text: the prompt that declares the tools, the parser of `<TOOLCALL>`
blocks fed one frame's piece at a time, and the text a tool's result goes back as."""

from __future__ import annotations

import json

import pytest

from plugins.nemotron.tools import (
    MAX_BLOCK_CHARS,
    ParsedFrame,
    ToolCallParser,
    render_function_output,
    render_system_prompt,
)
from shared.contracts import FunctionCall
from shared.protocol.duplex.errors import NEMOTRON_PARSE_ERROR

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CLOCK = {"type": "function", "name": "get_time"}
TOOLS = ("get_weather", "get_time")


def feed_all(parser: ToolCallParser, pieces: list[str]) -> ParsedFrame:
    """Every piece fed; their text, calls and errors put together."""
    text, calls, errors = [], [], []
    for piece in pieces:
        frame = parser.feed(piece)
        text.append(frame.text)
        calls.extend(frame.calls)
        if frame.error is not None:
            errors.append(frame.error)
    assert len(errors) <= 1, errors
    return ParsedFrame("".join(text), tuple(calls), errors[0] if errors else None)


# ---------------------------------------------------------------- the prompt


def test_the_prompt_is_the_instructions_alone_without_tools():
    assert render_system_prompt("Be brief.", []) == "Be brief."
    assert render_system_prompt("", []) == ""


def test_the_prompt_declares_the_tools_in_nemotrons_format():
    prompt = render_system_prompt("Be brief.", [WEATHER, CLOCK])
    declared = (
        '[{"description": "The weather in a city", "name": "get_weather", "parameters": '
        '{"properties": {"city": {"type": "string"}}, "type": "object"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    assert prompt == (
        "Be brief.\n\n"
        "You can use the following tools to assist the user if required:\n"
        f"<AVAILABLE_TOOLS>{declared}</AVAILABLE_TOOLS>\n"
        "\nIf you decide to call any tool(s), use the following format:\n"
        '<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, '
        '{"name": "tool_name2", "arguments": "tool_args2"}]</TOOLCALL>\n\n'
        "The user will execute tool-calls and return responses from tool(s) in this format:\n"
        '<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>\n\n'
        "Based on the tool responses, you can call additional tools if needed, correct tool "
        "calls if any errors are found, or just respond to the user."
    )
    # the declarations are JSON the model can read back: function objects, no "type"
    start = prompt.index("<AVAILABLE_TOOLS>") + len("<AVAILABLE_TOOLS>")
    body = json.loads(prompt[start : prompt.index("</AVAILABLE_TOOLS>")])
    assert [tool["name"] for tool in body] == ["get_weather", "get_time"]
    assert all("type" not in tool for tool in body)


def test_the_prompt_joins_instructions_and_tools_as_the_template_does():
    assert render_system_prompt("", [CLOCK]).startswith("You can use the following tools")
    assert render_system_prompt("Hi.\n", [CLOCK]).startswith("Hi.\nYou can use")


def test_the_prompt_is_ascii():
    tool = {"name": "greet", "description": "Sag Grüß Gott", "parameters": {}}
    prompt = render_system_prompt("Be brief.", [tool])
    assert prompt.isascii() and "Gr\\u00fc\\u00df" in prompt


# ---------------------------------------------------------------- tool results


@pytest.mark.parametrize(
    "output, rendered",
    [
        ('{"temp": 21}', '<TOOL_RESPONSE>[{"temp":21}]</TOOL_RESPONSE>'),
        ("[1, 2]", "<TOOL_RESPONSE>[1,2]</TOOL_RESPONSE>"),
        ("sunny", '<TOOL_RESPONSE>["sunny"]</TOOL_RESPONSE>'),
        ("", '<TOOL_RESPONSE>[""]</TOOL_RESPONSE>'),
        ("NaN", '<TOOL_RESPONSE>["NaN"]</TOOL_RESPONSE>'),
        ('"Zürich"', '<TOOL_RESPONSE>["Z\\u00fcrich"]</TOOL_RESPONSE>'),
    ],
)
def test_a_result_goes_back_as_a_tool_response(output, rendered):
    assert render_function_output("get_weather", output) == rendered


# ---------------------------------------------------------------- the parser


def test_text_without_tags_passes_through_exactly():
    parser = ToolCallParser(TOOLS)
    pieces = ["Hello", " there, ", "a < b and <TOOL", "S> are words.", ""]
    frame = feed_all(parser, pieces)
    assert frame.text == "".join(pieces) and frame.calls == () and frame.error is None


def test_a_call_between_words():
    parser = ToolCallParser(TOOLS)
    frame = parser.feed(
        'Let me check. <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        "</TOOLCALL> One moment."
    )
    assert frame.text == "Let me check.  One moment."
    assert frame.calls == (FunctionCall("get_weather", '{"city": "Paris"}'),)
    assert frame.error is None


SPOKEN = "Sure. "
BLOCK = (
    '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
    '{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}]</TOOLCALL>'
)
AFTER = " Checking <TOOLC"  # ends like the start of a tag, but is not one
TEXT = SPOKEN + BLOCK + AFTER + "ALL is not a tag."
CALLS = (
    FunctionCall("get_weather", '{"city": "Oslo"}'),
    FunctionCall("get_time", '{"zone": "CET"}'),
)


@pytest.mark.parametrize("cut", range(1, len(TEXT)))
def test_a_split_at_any_position_gives_the_same_text_and_calls(cut):
    frame = feed_all(ToolCallParser(TOOLS), [TEXT[:cut], TEXT[cut:]])
    assert frame.text == SPOKEN + AFTER + "ALL is not a tag."
    assert frame.calls == CALLS and frame.error is None


def test_one_character_at_a_time():
    parser = ToolCallParser(TOOLS)
    frames = [parser.feed(char) for char in TEXT]
    assert "".join(f.text for f in frames) == SPOKEN + AFTER + "ALL is not a tag."
    made = [i for i, f in enumerate(frames) if f.calls]
    assert made == [len(SPOKEN) + len(BLOCK) - 1]  # the calls come with the block's last char
    assert frames[made[0]].calls == CALLS


def test_text_that_may_start_a_tag_is_held_until_resolved():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("Hi <TOOL").text == "Hi "
    assert not parser.in_call
    assert parser.feed("CALL>").text == ""
    assert parser.in_call
    assert parser.feed('[{"name": "get_time"}]</TOOL').calls == ()
    frame = parser.feed("CALL>bye")
    assert frame.calls == (FunctionCall("get_time", "{}"),) and frame.text == "bye"


def test_several_blocks_in_one_piece_and_across_pieces():
    parser = ToolCallParser(TOOLS)
    frame = parser.feed(
        '<TOOLCALL>[{"name": "get_time"}]</TOOLCALL>and<TOOLCALL>{"name": "get_weather", '
        '"arguments": {}}</TOOLCALL><TOOLCALL>[{"name": "get_'
    )
    assert frame.text == "and"
    assert [c.name for c in frame.calls] == ["get_time", "get_weather"]
    frame = parser.feed('time"}]</TOOLCALL>')
    assert [c.name for c in frame.calls] == ["get_time"] and frame.text == ""


@pytest.mark.parametrize(
    "body, message",
    [
        ("[{'name': 'get_time'}]", "not valid JSON"),
        ('[{"name": "get_time"}', "not valid JSON"),
        ("[]", "non-empty JSON list"),
        ('"get_time"', "non-empty JSON list"),
        ('[{"arguments": {}}]', "string name"),
        ('[{"name": 3}]', "string name"),
        ('[{"name": "get_stock"}]', "'get_stock', not a tool of this session"),
        ('[{"name": "get_time", "arguments": [1]}]', "arguments of 'get_time' are not"),
        ('[{"name": "get_time", "arguments": "oops"}]', "arguments of 'get_time' are not"),
        ('[{"name": "get_time", "arguments": "[1]"}]', "arguments of 'get_time' are not"),
        ('[{"name": "get_time", "arguments": {"x": NaN}}]', "not valid JSON"),
        ("[" * 4000 + "]" * 4000, "not valid JSON"),
    ],
)
def test_a_bad_block_is_a_parse_error_and_makes_no_call(body, message):
    parser = ToolCallParser(TOOLS)
    frame = parser.feed(f"a<TOOLCALL>{body}</TOOLCALL>b")
    assert frame.text == "ab" and frame.calls == ()
    assert frame.error is not None
    code, text = frame.error
    assert code == NEMOTRON_PARSE_ERROR == "nemotron_function_call_parse_error"
    assert message in text
    # the parser goes on: the next block is read
    assert parser.feed('<TOOLCALL>[{"name": "get_time"}]</TOOLCALL>').calls


def test_a_block_with_one_bad_call_makes_none_of_its_calls():
    parser = ToolCallParser(TOOLS)
    frame = parser.feed('<TOOLCALL>[{"name": "get_time"}, {"name": "nope"}]</TOOLCALL>')
    assert frame.calls == () and frame.error is not None


def test_the_first_error_of_a_piece_is_kept_and_good_blocks_still_call():
    parser = ToolCallParser(TOOLS)
    frame = parser.feed(
        '<TOOLCALL>[{"name": "x"}]</TOOLCALL><TOOLCALL>[{"name": "get_time"}]</TOOLCALL>'
        "<TOOLCALL>not json</TOOLCALL>"
    )
    assert frame.calls == (FunctionCall("get_time", "{}"),)
    assert frame.error is not None and "'x'" in frame.error[1]


def test_a_session_without_tools_has_every_call_refused():
    frame = ToolCallParser(()).feed('<TOOLCALL>[{"name": "get_time"}]</TOOLCALL>')
    assert frame.calls == () and frame.error is not None and "(none)" in frame.error[1]


def test_an_overlong_block_is_an_error_and_its_rest_is_skipped_unheld():
    parser = ToolCallParser(TOOLS, max_block_chars=64)
    assert parser.feed("go <TOOLCALL>" + "x" * 60).error is None
    frame = parser.feed("y" * 10)
    assert frame.error is not None and "longer than 64" in frame.error[1]
    assert frame.text == "" and parser.in_call
    for _ in range(1000):  # memory stays bounded while the block goes on
        assert parser.feed("z" * 100) == ParsedFrame()
        assert len(parser._buffer) < len("</TOOLCALL>")
    assert parser.feed("zz</TOOL") == ParsedFrame()
    frame = parser.feed('CALL> done <TOOLCALL>[{"name": "get_time"}]</TOOLCALL>')
    assert frame.text == " done " and frame.calls == (FunctionCall("get_time", "{}"),)
    assert frame.error is None


def test_an_overlong_block_closed_in_one_piece_is_an_error():
    parser = ToolCallParser(TOOLS, max_block_chars=32)
    body = json.dumps([{"name": "get_weather", "arguments": {"city": "x" * 40}}])
    frame = parser.feed(f"<TOOLCALL>{body}</TOOLCALL>after")
    assert frame.calls == () and frame.error is not None and frame.text == "after"


def test_the_default_bound_is_8_kib():
    assert MAX_BLOCK_CHARS == 8 * 1024
    parser = ToolCallParser(TOOLS)
    arguments = {"note": "n" * 8000}
    body = json.dumps([{"name": "get_time", "arguments": arguments}])
    assert len(body) <= MAX_BLOCK_CHARS
    assert parser.feed(f"<TOOLCALL>{body}</TOOLCALL>").calls
    with pytest.raises(ValueError):
        ToolCallParser(TOOLS, max_block_chars=0)


def test_reset_forgets_an_open_block_and_held_text():
    parser = ToolCallParser(TOOLS)
    parser.feed('<TOOLCALL>[{"name": "get_')
    parser.reset()
    assert not parser.in_call
    assert parser.feed('time"}]</TOOLCALL> hi') == ParsedFrame('time"}]</TOOLCALL> hi')
    parser.feed("and <TOOLC")
    parser.reset()
    assert parser.feed("ALL>") == ParsedFrame("ALL>")


def test_a_stray_end_tag_is_text():
    frame = ToolCallParser(TOOLS).feed("a </TOOLCALL> b")
    assert frame == ParsedFrame("a </TOOLCALL> b")


def test_the_output_is_a_pure_function_of_the_pieces():
    """A model restores the parser by feeding its history's text again: the same pieces give
    the same outputs, whatever came before a reset."""
    pieces = ["Hi <TOOL", 'CALL>[{"name": "get_time"}]</TOOL', "CALL> ok", "<TOOLCALL>[{"]
    first = ToolCallParser(TOOLS)
    outputs = [first.feed(piece) for piece in pieces]
    second = ToolCallParser(TOOLS)
    second.feed("junk <TOOLCALL> junk")
    second.reset()
    assert [second.feed(piece) for piece in pieces] == outputs
    assert (first._mode, first._buffer) == (second._mode, second._buffer)
