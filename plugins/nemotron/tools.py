"""Tool calling in Nemotron VoiceChat's text: the prompt that declares the tools, the parser
of the model's `<TOOLCALL>` blocks, and the text a tool's result is fed back as. Pure Python
(no torch): the plugin renders the prompt when a session opens, the model's frame loop parses.

The format is Nemotron Nano v2's (the VoiceChat LLM backbone is Nemotron Nano V2 9B), as
NVIDIA's function-calling template for VoiceChat renders it
(NVIDIA-NeMo/Speech, branch nemotron-labs-voicechat,
`examples/speechlm2/function_calling/template.jinja`, read here through an NVIDIA
re-implementation that states it is byte-compatible with it, and checked against vLLM's
`examples/tool_chat_template_nemotron_nano_v2.jinja` and its `nemotron_nano_v2` tool parser
in `vllm/tool_parsers/nemotron_nano_v2_tool_parser.py`):

    <instructions>

    You can use the following tools to assist the user if required:
    <AVAILABLE_TOOLS>[{"description": ..., "name": ..., "parameters": {...}}]</AVAILABLE_TOOLS>

    If you decide to call any tool(s), use the following format:
    <TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, ...]</TOOLCALL>
    ...

- the tools are the function objects (`name`, `description`, `parameters`; no `type`), as
  Jinja's `tojson` writes them: keys sorted, `", "` and `": "` separators, ASCII escapes
  (VoiceChat's model card asks for ASCII-only prompts);
- a call is `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`: a JSON list of
  calls (VoiceChat emits it on its function channel; `ToolCallParser` reads either channel);
- a result goes back as `<TOOL_RESPONSE>[...]</TOOL_RESPONSE>`: the output as JSON (text that
  is not JSON becomes a JSON string) inside a list. Nemotron's format carries no tool name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shared.contracts import FunctionCall
from shared.protocol.duplex.errors import NEMOTRON_PARSE_ERROR

OPEN, CLOSE = "<TOOLCALL>", "</TOOLCALL>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<TOOL_RESPONSE>", "</TOOL_RESPONSE>"
#: the longest `<TOOLCALL>` block (its characters between the tags); a longer one is an error
MAX_BLOCK_CHARS = 8 * 1024

TOOLS_PREAMBLE = "You can use the following tools to assist the user if required:\n"
TOOLS_PROTOCOL = (
    "\nIf you decide to call any tool(s), use the following format:\n"
    '<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, '
    '{"name": "tool_name2", "arguments": "tool_args2"}]</TOOLCALL>\n\n'
    "The user will execute tool-calls and return responses from tool(s) in this format:\n"
    '<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>\n\n'
    "Based on the tool responses, you can call additional tools if needed, correct tool "
    "calls if any errors are found, or just respond to the user."
)


def _declaration(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A session tool (`shared.contracts.tools` shape) as the function object Nemotron reads."""
    out: dict[str, Any] = {"name": tool["name"], "parameters": tool.get("parameters") or {}}
    if tool.get("description"):
        out["description"] = tool["description"]
    return out


def render_system_prompt(instructions: str, tools: Sequence[Mapping[str, Any]]) -> str:
    """The text prompt the model reads before the conversation: `instructions`, then (when
    there are tools) their declarations and the call protocol (module docstring)."""
    prompt = instructions or ""
    if not tools:
        return prompt
    if prompt and not prompt.endswith("\n"):
        prompt += "\n\n"
    declared = json.dumps([_declaration(tool) for tool in tools], sort_keys=True)
    tools_block = f"<AVAILABLE_TOOLS>{declared}</AVAILABLE_TOOLS>\n"
    return f"{prompt}{TOOLS_PREAMBLE}{tools_block}{TOOLS_PROTOCOL}"


def render_function_output(name: str, output: str) -> str:
    """The text fed back to the model as the result of a call of `name`: the output as JSON
    in a list (a JSON list as it is; text that is not JSON as a JSON string), compact, ASCII.
    `name` is not part of Nemotron's format: the model pairs results with its calls by order."""
    try:
        value: Any = json.loads(output, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        value = output
    payload = value if isinstance(value, list) else [value]
    try:
        text = json.dumps(payload, separators=(",", ":"))
    except (ValueError, RecursionError):  # nested past the encoder's depth: send it as text
        text = json.dumps([output], separators=(",", ":"))
    return f"{RESPONSE_OPEN}{text}{RESPONSE_CLOSE}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@dataclasses.dataclass(frozen=True)
class ParsedFrame:
    """What one piece of the model's text holds once its tags are taken out."""

    #: the words outside `<TOOLCALL>` blocks (what is spoken / transcribed)
    text: str = ""
    #: the calls of the blocks that closed in this piece, in order (`call_id` None: the
    #: worker names them)
    calls: tuple[FunctionCall, ...] = ()
    #: (NEMOTRON_PARSE_ERROR, message) for the piece's first block that was not a valid call
    error: tuple[str, str] | None = None


_TEXT, _BLOCK, _SKIP = "text", "block", "skip"


class ToolCallParser:
    """Splits the model's text, one frame's piece at a time, into speech and tool calls.

    A `<TOOLCALL>...</TOOLCALL>` block is a JSON list of calls (one object alone is taken as
    a list of one), each `{"name": <a session tool>, "arguments": <object, or a JSON string
    of one; absent: {}>}`. A block is taken whole: one bad call (not JSON, an unknown tool,
    arguments that are not an object), an empty list, or more than `max_block_chars`
    between the tags makes the block an error and none of its calls are made; an overlong
    block's rest is skipped up to its `</TOOLCALL>` without being held. Tags may be split
    across pieces: a piece's tail that may begin `<TOOLCALL>` is held until the next piece
    tells. A stray `</TOOLCALL>` outside a block is text.

    The state is a mode and at most `max_block_chars` + a piece of text: the output is a
    pure function of the pieces fed since the last `reset`, so a model restores it by
    feeding its history's text again.
    """

    def __init__(self, tool_names: Iterable[str], max_block_chars: int = MAX_BLOCK_CHARS) -> None:
        if max_block_chars < 1:
            raise ValueError("max_block_chars must be at least 1")
        self.tool_names = frozenset(tool_names)
        self.max_block_chars = max_block_chars
        self._mode = _TEXT
        #: _TEXT: a held tail that may start OPEN; _BLOCK: the block so far; _SKIP: a tail
        #: that may start CLOSE
        self._buffer = ""

    @property
    def in_call(self) -> bool:
        """Whether a block is open (the model is writing a call, or skipping a bad one)."""
        return self._mode != _TEXT

    def reset(self) -> None:
        """Forget a block in progress and any held text (a barge-in: the output stops)."""
        self._mode = _TEXT
        self._buffer = ""

    def feed(self, piece: str) -> ParsedFrame:
        """The next piece of the model's text; what it completes."""
        text: list[str] = []
        calls: list[FunctionCall] = []
        error: tuple[str, str] | None = None
        buffer = self._buffer + piece
        while True:
            if self._mode == _TEXT:
                start = buffer.find(OPEN)
                if start < 0:
                    keep = _prefix_tail(buffer, OPEN)
                    text.append(buffer[: len(buffer) - keep])
                    buffer = buffer[len(buffer) - keep :]
                    break
                text.append(buffer[:start])
                buffer = buffer[start + len(OPEN) :]
                self._mode = _BLOCK
            elif self._mode == _BLOCK:
                end = buffer.find(CLOSE)
                if end < 0 and len(buffer) <= self.max_block_chars:
                    break
                if end < 0 or end > self.max_block_chars:
                    error = error or (
                        NEMOTRON_PARSE_ERROR,
                        f"a tool call block is longer than {self.max_block_chars} characters",
                    )
                    self._mode = _SKIP
                    continue
                try:
                    calls.extend(self._parse(buffer[:end]))
                except ValueError as bad:
                    error = error or (NEMOTRON_PARSE_ERROR, str(bad))
                buffer = buffer[end + len(CLOSE) :]
                self._mode = _TEXT
            else:  # _SKIP: the rest of an overlong block, up to its end tag
                end = buffer.find(CLOSE)
                if end < 0:
                    buffer = buffer[len(buffer) - _prefix_tail(buffer, CLOSE) :]
                    break
                buffer = buffer[end + len(CLOSE) :]
                self._mode = _TEXT
        self._buffer = buffer
        return ParsedFrame("".join(text), tuple(calls), error)

    def _parse(self, body: str) -> list[FunctionCall]:
        """The calls of one block, or ValueError saying why it is not a valid one."""
        try:
            value = json.loads(body, parse_constant=_no_constant)
        except (ValueError, RecursionError) as bad:
            raise ValueError(f"a tool call block is not valid JSON: {bad}") from None
        items = [value] if isinstance(value, dict) else value
        if not isinstance(items, list) or not items:
            raise ValueError("a tool call block must be a non-empty JSON list of calls")
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise ValueError("each tool call must be an object with a string name")
            name = item["name"]
            if name not in self.tool_names:
                known = ", ".join(sorted(self.tool_names)) or "none"
                raise ValueError(f"the model called {name!r}, not a tool of this session ({known})")
            calls.append(FunctionCall(name, _arguments(name, item.get("arguments", {}))))
        return calls


def _arguments(name: str, arguments: Any) -> str:
    """A call's arguments as JSON text of an object (a string holding one is read first)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            raise ValueError(f"the arguments of {name!r} are not a JSON object") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of {name!r} are not a JSON object")
    try:
        return json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):  # nested past the encoder's depth
        raise ValueError(f"the arguments of {name!r} are nested too deep") from None


def _prefix_tail(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


__all__ = [
    "CLOSE",
    "MAX_BLOCK_CHARS",
    "OPEN",
    "ParsedFrame",
    "ToolCallParser",
    "render_function_output",
    "render_system_prompt",
]
