"""OpenBMB's MAP Realtime V1 vocabulary where two processes build its events: the worker's
projection of a "map" session (services/worker/engine/native_surfaces.py) and the API pod's
socket (services/api/map_realtime.py), which speaks for a session no worker holds any more.

MAP Realtime V1 is the protocol of OpenBMB's realtime SDK for MiniCPM-o (`openbmb-realtime`
on PyPI): `/v1/realtime?mode=audio|video&model=...` with the WebSocket subprotocol
`map.realtime`. Its audio is base64 float32 mono, 16 kHz in and 24 kHz out.

The SDK takes any `error` event as the session's end: it marks the session failed and
closes its socket. So an error is sent as `error` only when the session does end (its
code is one of `ENDING_CODES`, or the pod ends the socket after it); a refusal the session
outlives (an append not taken, a message not understood) is a `warning` event of the same
body, which the SDK leaves alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.protocol.duplex.errors import STREAM_FAILED, WORKER_LOST

#: the WebSocket subprotocol that names the protocol on `/v1/realtime`
MAP_SUBPROTOCOL = "map.realtime"
#: the route's `mode` query values
MAP_MODES = ("audio", "video")
#: the audio both ways: base64 of little-endian float32 mono samples at these rates
MAP_INPUT_RATE_HZ = 16_000
MAP_OUTPUT_RATE_HZ = 24_000
#: the journal's type of the model's readiness on a map session: the pod sends it as MAP's
#: `session.created` (our `session.created` is the open's reply, never journaled)
MAP_READY = "session.started"
#: the refusal the session outlives (the SDK ignores an event type it does not know)
MAP_WARNING = "warning"
#: the codes of the errors after which the session is closed: a lost worker no other could
#: replace, a model slot that could not open, a client that reads too slowly
ENDING_CODES = frozenset({WORKER_LOST, STREAM_FAILED, "output_overflow"})


def map_error_object(error: Mapping[str, Any]) -> dict[str, Any]:
    """Our `error` object (`DuplexErrorEvent.error_body()`: type, code, message, param?,
    event_id?, retryable?) as MAP has it: its client events carry no id, so there is none
    to echo."""
    return {k: v for k, v in error.items() if k != "event_id" and v is not None}


def map_refusal(error: Mapping[str, Any], *, ends: bool | None = None) -> dict[str, Any]:
    """The event an error is on a map session: `error` when it ends the session (`ends`, or
    by default its code is one of `ENDING_CODES`), else a `warning` of the same body."""
    if ends is None:
        ends = error.get("code") in ENDING_CODES
    kind = "error" if ends else MAP_WARNING
    return {"type": kind, kind: map_error_object(error)}


def map_closed(reason: str | None) -> dict[str, Any]:
    """The body of `session.closed`: our closure reason as it is (docs/wire-api.md)."""
    return {"reason": reason or "closed"}


__all__ = [
    "ENDING_CODES",
    "MAP_INPUT_RATE_HZ",
    "MAP_MODES",
    "MAP_OUTPUT_RATE_HZ",
    "MAP_READY",
    "MAP_SUBPROTOCOL",
    "MAP_WARNING",
    "map_closed",
    "map_error_object",
    "map_refusal",
]
