"""Tool calls in an LLM's text, Hermes style (as Qwen2.5 and Hermes models emit them).

The prompt lists the tools, one JSON object a line, and asks for a call as

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

History renders the same way: a `function_call` item is the assistant's line with that
markup, a `function_call_output` item is `Tool: <tool_response>OUTPUT</tool_response>`.

`ToolCallText` reads the generated text as it streams: what comes before the first
`<tool_call>` is speech; each `<tool_call>...</tool_call>` block is parsed into a call
(JSON with a string `name` and an `arguments` object or JSON string; a block still open
when generation ends is parsed as it is); text after the first call is not spoken (the
answer comes after the client's output). A block that does not parse, or names a tool the
response may not call, is dropped (logged): the response then completes without it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shared.contracts import FunctionCall
from shared.contracts.tools import ToolChoice

log = logging.getLogger(__name__)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tools_prompt(tools: Sequence[Mapping[str, Any]], tool_choice: ToolChoice) -> list[str]:
    """The prompt's lines that offer `tools` (none when there are none to call)."""
    if not tools:
        return []
    lines = ["You can call these tools:"]
    lines += [json.dumps(dict(tool), separators=(", ", ": ")) for tool in tools]
    lines.append(
        f'To call one, answer with one line: {OPEN}{{"name": "<tool name>", '
        f'"arguments": {{<arguments>}}}}{CLOSE}'
    )
    if isinstance(tool_choice, Mapping):
        lines.append(f"You must call the tool {tool_choice.get('name')}.")
    elif tool_choice == "required":
        lines.append("You must call one of these tools.")
    return lines


def call_line(item: Mapping[str, Any]) -> str:
    """A history item of a tool call or its output, as a prompt line ("" for others)."""
    if item.get("type") == "function_call":
        text = str(item.get("arguments") or "{}")
        try:  # the client may have made the item: its arguments may be anything
            body = json.dumps({"name": item.get("name"), "arguments": json.loads(text)})
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            body = json.dumps({"name": item.get("name"), "arguments": item.get("arguments")})
        return f"Assistant: {OPEN}{body}{CLOSE}"
    if item.get("type") == "function_call_output":
        return f"Tool: <tool_response>{item.get('output', '')}</tool_response>"
    return ""


def parse_call(body: str, allowed: Iterable[str]) -> FunctionCall | None:
    """The call in one `<tool_call>` block, or None (logged) when it is not a valid call
    of an allowed tool."""
    try:
        value = json.loads(body.strip())
    except (ValueError, RecursionError):
        log.warning("dropped a tool call that is not JSON: %.200r", body)
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        log.warning("dropped a tool call without a name: %.200r", body)
        return None
    if value["name"] not in set(allowed):
        log.warning("dropped a call of %r, not a tool this response may call", value["name"])
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        text = arguments  # already JSON text (some models emit it so)
    elif isinstance(arguments, Mapping):
        text = json.dumps(arguments)
    else:
        log.warning("dropped a call of %r: arguments are not an object", value["name"])
        return None
    return FunctionCall(value["name"], text)


class ToolCallText:
    """Splits streamed LLM text into speech and tool calls (module head)."""

    def __init__(self, allowed: Iterable[str]) -> None:
        self.allowed = tuple(allowed)
        self.calls: list[FunctionCall] = []
        self._buffer = ""
        self._in_call = False
        self._called = False  # a block was opened: nothing after it is spoken

    def feed(self, text: str) -> str:
        """Take the next piece of generated text; return what of it may be spoken now."""
        self._buffer += text
        speech = ""
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return speech
                self._add(self._buffer[:end])
                self._buffer = self._buffer[end + len(CLOSE) :]
                self._in_call = False
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                speech += self._speech(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN) :]
                self._in_call = self._called = True
                continue
            # hold back a tail that may be the start of a tag split across two pieces
            keep = _tag_prefix_len(self._buffer)
            cut = len(self._buffer) - keep
            speech += self._speech(self._buffer[:cut])
            self._buffer = self._buffer[cut:]
            return speech

    def finish(self) -> str:
        """Generation ended: parse a block left open, return the speech held back."""
        rest, self._buffer = self._buffer, ""
        if self._in_call:
            self._in_call = False
            self._add(rest)
            return ""
        return self._speech(rest)

    def _speech(self, text: str) -> str:
        return "" if self._called else text

    def _add(self, body: str) -> None:
        call = parse_call(body, self.allowed)
        if call is not None:
            self.calls.append(call)


def _tag_prefix_len(text: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `<tool_call>`."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
