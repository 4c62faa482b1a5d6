"""GPT-Live's vocabulary where two processes build its events: the worker's projection of a
"live" session (services/worker/engine/native_surfaces.py) and the API pod's socket
(services/api/live_sessions.py), which speaks for a session no worker holds any more.

GPT-Live (OpenAI's full-duplex API, `/v1/live/sessions`) reports usage as cumulative
seconds of the session, and closes with one of five reasons.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: GPT-Live's `session.closed` reasons
LIVE_CLOSE_REASONS = ("close_requested", "expired", "content", "remote_hangup", "connection_lost")
#: our close and expiry reasons -> GPT-Live's; any other is `connection_lost`
CLOSE_REASONS = {
    "client_close": "close_requested",
    "timeout": "expired",
    "idle_ttl_expired": "expired",
    "disconnect_grace_expired": "expired",
    "request_cleanup": "expired",
}


def live_error_body(error: Mapping[str, Any]) -> dict[str, Any]:
    """Our `error` object (`DuplexErrorEvent.error_body()`: type, code, message, param?,
    event_id?, retryable?) as GPT-Live has it: the client's event id is `client_event_id`,
    and there is no `retryable`."""
    body = {k: v for k, v in error.items() if k not in ("event_id", "retryable")}
    if error.get("event_id") is not None:
        body["client_event_id"] = error["event_id"]
    return body


def live_usage(ms: int) -> dict[str, Any]:
    """`usage`: the session's seconds so far."""
    return {"seconds": round(ms / 1000, 3)}


def live_close_reason(reason: str | None) -> str:
    return CLOSE_REASONS.get(reason or "", "connection_lost")


def live_closed(reason: str | None, ms: int) -> dict[str, Any]:
    """The body of `session.closed` for one of our reasons, after `ms` of the session."""
    return {"reason": live_close_reason(reason), "usage": live_usage(ms)}


__all__ = [
    "CLOSE_REASONS",
    "LIVE_CLOSE_REASONS",
    "live_close_reason",
    "live_closed",
    "live_error_body",
    "live_usage",
]
