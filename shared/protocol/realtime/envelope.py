"""Client frame -> JSON object, with the envelope's own error codes.

Order of checks: size (before parsing anything), JSON syntax, then shape.
"""

from __future__ import annotations

from typing import Any

import orjson

from shared.protocol.realtime.errors import RealtimeProtocolError


def utf8_length_exceeds(frame: str, limit: int) -> bool:
    """Whether a text frame's UTF-8 length is over `limit`, without encoding it when avoidable."""
    if len(frame) > limit:
        return True
    if len(frame) * 4 <= limit:
        return False
    return len(frame.encode("utf-8", "surrogatepass")) > limit


# orjson decodes up to 1024 levels but encodes only up to 254: an event between the two was
# accepted, then failed when the API re-encoded it for the worker (found by bench/fuzz.py).
# No client event of the contract comes near this depth.
MAX_JSON_DEPTH = 64


def nesting_exceeds(value: Any, limit: int) -> bool:
    """True when containers nest deeper than `limit` (iterative: no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def decode_client_frame(frame: str | bytes, *, max_bytes: int) -> dict[str, Any]:
    """The JSON object of one client frame.

    Raises `event_too_large` (over `max_bytes` UTF-8 bytes), `invalid_json`,
    or `bad_event` (not an object, or no string `type`).
    """
    too_large = (
        len(frame) > max_bytes
        if isinstance(frame, bytes)
        else utf8_length_exceeds(frame, max_bytes)
    )
    if too_large:
        raise RealtimeProtocolError(
            "event_too_large", f"client event exceeds the {max_bytes}-byte limit"
        )
    try:
        obj = orjson.loads(frame)
    except orjson.JSONDecodeError as exc:
        raise RealtimeProtocolError(
            "invalid_json", f"client event is not valid JSON: {exc}"
        ) from None
    if not isinstance(obj, dict):
        raise RealtimeProtocolError("bad_event", "client event must be a JSON object")
    if nesting_exceeds(obj, MAX_JSON_DEPTH):
        raise RealtimeProtocolError(
            "invalid_json", f"client event is nested deeper than {MAX_JSON_DEPTH} levels"
        )
    event_id = obj.get("event_id") if isinstance(obj.get("event_id"), str) else None
    if not isinstance(obj.get("type"), str) or not obj["type"]:
        raise RealtimeProtocolError(
            "bad_event",
            "client event needs a string 'type'",
            param="type",
            related_event_id=event_id,
        )
    return obj
