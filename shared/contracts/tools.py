"""Function tools a client declares, in the OpenAI Realtime GA shape: their validation, and
which of them one response may call.

A tool is `{"type": "function", "name", "description"?, "parameters"?}` (`type` may be left
out; `name` matches `^[A-Za-z0-9_-]{1,64}$` as OpenAI requires; `parameters`, a JSON Schema,
must be an object). `tool_choice` is `"auto"` (the default), `"none"`, `"required"` or
`{"type": "function", "name"}`. At most `MAX_TOOLS` tools (OpenAI's limit), each
`description` at most `MAX_DESCRIPTION_CHARS` characters and each `parameters` at most
`MAX_PARAMETERS_BYTES` as compact JSON. Anything else is refused with `invalid_tools` (MCP
tools and choices included: no model here can call them). Tools arrive from `session.update`
(kept as `extra_body.realtime_tools` / `realtime_tool_choice`) and per response from
`response.create` (`realtime_response_tools` / `realtime_response_tool_choice`), which
replace the session's for that response.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from shared.contracts.host import DuplexSessionError

TOOL_CHOICES = ("auto", "none", "required")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: the most tools one declaration may hold (OpenAI's limit)
MAX_TOOLS = 128
#: the longest tool description, in characters
MAX_DESCRIPTION_CHARS = 4096
#: the largest tool parameters schema, in bytes of compact JSON
MAX_PARAMETERS_BYTES = 64 * 1024

#: a validated tool_choice: one of TOOL_CHOICES, or {"type": "function", "name": ...}
ToolChoice = str | Mapping[str, Any]


def _invalid(message: str, param: str) -> DuplexSessionError:
    return DuplexSessionError("invalid_tools", message, param=param)


def read_tools(value: Any, param: str = "tools") -> tuple[dict[str, Any], ...]:
    """The validated function tools of a `tools` declaration (None reads as none)."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise _invalid("tools must be a list of function tools", param)
    if len(value) > MAX_TOOLS:
        raise _invalid(f"at most {MAX_TOOLS} tools may be declared", param)
    tools: list[dict[str, Any]] = []
    names: set[str] = set()
    for index, tool in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(tool, Mapping):
            raise _invalid("a tool must be an object", where)
        kind = tool.get("type", "function")
        if kind != "function":
            raise _invalid(f"tool type {kind!r} is not served: only function tools", where)
        name = tool.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise _invalid("a function tool needs a name matching ^[A-Za-z0-9_-]{1,64}$", where)
        if name in names:
            raise _invalid(f"tool {name!r} is declared twice", where)
        names.add(name)
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid("a tool's description must be a string", f"{where}.description")
        if description is not None and len(description) > MAX_DESCRIPTION_CHARS:
            raise _invalid(
                f"a tool's description is at most {MAX_DESCRIPTION_CHARS} characters",
                f"{where}.description",
            )
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise _invalid("a tool's parameters must be a JSON Schema object", where)
        if parameters is not None:
            _check_size(parameters, f"{where}.parameters")
        out: dict[str, Any] = {"type": "function", "name": name}
        if description is not None:
            out["description"] = description
        if parameters is not None:
            out["parameters"] = dict(parameters)
        tools.append(out)
    return tuple(tools)


def _check_size(parameters: Mapping[str, Any], where: str) -> None:
    """Refuse parameters over MAX_PARAMETERS_BYTES of compact JSON (serialized once, in C:
    the frame that carried them is bounded, so this is too), or that are not JSON."""
    try:
        size = len(orjson.dumps(parameters))
    except orjson.JSONEncodeError as exc:  # nested too deep, or not JSON values
        raise _invalid(f"a tool's parameters must be JSON: {exc}", where) from None
    if size > MAX_PARAMETERS_BYTES:
        raise _invalid(
            f"a tool's parameters are at most {MAX_PARAMETERS_BYTES} bytes of JSON", where
        )


def read_tool_choice(value: Any, param: str = "tool_choice") -> ToolChoice:
    """A validated `tool_choice` (None reads as "auto")."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise _invalid(f"tool_choice must be one of {TOOL_CHOICES} or a function", param)
        return value
    if isinstance(value, Mapping) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid("a function tool_choice needs a name", f"{param}.name")
        return {"type": "function", "name": name}
    raise _invalid(f"tool_choice must be one of {TOOL_CHOICES} or a function", param)


def check_session_tools(extra_body: Mapping[str, Any]) -> None:
    """Refuse a session whose declared tools or tool_choice are malformed."""
    read_tools(extra_body.get("realtime_tools"))
    read_tool_choice(extra_body.get("realtime_tool_choice"))


def callable_tools(
    tools: Sequence[Mapping[str, Any]], tool_choice: ToolChoice
) -> tuple[Mapping[str, Any], ...]:
    """The tools a response may call: none under "none", the named one when forced (none if
    it is not declared), all of them otherwise."""
    if tool_choice == "none":
        return ()
    if isinstance(tool_choice, Mapping):
        return tuple(tool for tool in tools if tool.get("name") == tool_choice.get("name"))
    return tuple(tools)


def must_call(tool_choice: ToolChoice) -> bool:
    """Whether the response has to call a tool ("required", or a forced function)."""
    return tool_choice == "required" or isinstance(tool_choice, Mapping)


__all__ = [
    "MAX_DESCRIPTION_CHARS",
    "MAX_PARAMETERS_BYTES",
    "MAX_TOOLS",
    "TOOL_CHOICES",
    "ToolChoice",
    "callable_tools",
    "check_session_tools",
    "must_call",
    "read_tool_choice",
    "read_tools",
]
