"""Conversation item shape: validation and normalisation of client items.

A client's `conversation.item.create` carries an item in the OpenAI shape. We
check what we can serve and fill what the server owns (`object`), so every
later consumer sees one shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.protocol.realtime.errors import RealtimeProtocolError

ITEM_TYPES = ("message", "function_call", "function_call_output")
ROLES = ("user", "assistant", "system")
#: content part types a client may send, per role.
PART_TYPES: dict[str, frozenset[str]] = {
    "user": frozenset({"input_text", "input_audio", "input_image"}),
    "assistant": frozenset({"output_text", "output_audio", "text", "audio"}),
    "system": frozenset({"input_text"}),
}


def _bad_item(message: str, param: str = "item") -> RealtimeProtocolError:
    return RealtimeProtocolError("bad_event", message, param=param)


def normalize_item(item: Any) -> dict[str, Any]:
    """A validated copy of a client item with `type` and `object` filled in."""
    if not isinstance(item, Mapping):
        raise _bad_item("conversation item must be an object")
    out = dict(item)
    item_type = out.setdefault("type", "message")
    out["object"] = "realtime.item"
    if item_type not in ITEM_TYPES:
        raise _bad_item(
            f"unsupported item type {item_type!r}; expected one of {ITEM_TYPES}", "item.type"
        )
    if "id" in out and not isinstance(out["id"], str):
        raise _bad_item("item.id must be a string", "item.id")
    if item_type == "message":
        role = out.get("role")
        if role not in ROLES:
            raise _bad_item(f"message role must be one of {ROLES}, got {role!r}", "item.role")
        content = out.get("content", [])
        if not isinstance(content, list):
            raise _bad_item("message content must be a list of parts", "item.content")
        allowed = PART_TYPES[role]
        for index, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") not in allowed:
                raise _bad_item(
                    f"content part {index} of a {role} message must be one of {sorted(allowed)}",
                    f"item.content[{index}]",
                )
        out["content"] = [dict(part) for part in content]
    elif item_type == "function_call_output":
        if not isinstance(out.get("call_id"), str) or not isinstance(out.get("output"), str):
            raise RealtimeProtocolError(
                "invalid_function_call_output",
                "function_call_output needs string call_id and output",
                param="item",
            )
    else:  # function_call
        for key in ("name", "call_id", "arguments"):
            if not isinstance(out.get(key), str):
                raise _bad_item(f"function_call needs a string {key!r}", f"item.{key}")
    return out


def item_text(item: Mapping[str, Any]) -> str:
    """All text and transcripts of an item, joined (for history and transcripts)."""
    pieces = []
    for part in item.get("content") or []:
        for key in ("text", "transcript"):
            value = part.get(key)
            if isinstance(value, str) and value:
                pieces.append(value)
    return "".join(pieces)
