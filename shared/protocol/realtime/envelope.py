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
    event_id = obj.get("event_id") if isinstance(obj.get("event_id"), str) else None
    if not isinstance(obj.get("type"), str) or not obj["type"]:
        raise RealtimeProtocolError(
            "bad_event",
            "client event needs a string 'type'",
            param="type",
            related_event_id=event_id,
        )
    return obj
