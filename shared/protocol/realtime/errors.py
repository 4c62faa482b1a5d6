"""The error envelope's exception and OpenAI's three `error.type` classes.

The error *codes* are ours (Tier 3, `shared.protocol.duplex.errors`); the
Realtime codec raises them by name so that it never depends on that table.
"""

from __future__ import annotations

from shared.errors import CodedError, register_code_table

INVALID_REQUEST_ERROR = "invalid_request_error"
SERVER_ERROR = "server_error"
RATE_LIMIT_ERROR = "rate_limit_error"
ERROR_TYPES = (INVALID_REQUEST_ERROR, SERVER_ERROR, RATE_LIMIT_ERROR)

__all__ = [
    "ERROR_TYPES",
    "INVALID_REQUEST_ERROR",
    "RATE_LIMIT_ERROR",
    "SERVER_ERROR",
    "CodedError",
    "RealtimeProtocolError",
    "register_code_table",
]


class RealtimeProtocolError(CodedError):
    """A client event (or part of one) was rejected.

    `related_event_id` is the client's own `event_id`, echoed back as
    `error.event_id` so the client can correlate the rejection.
    """

    def with_event_id(self, event_id: str | None) -> RealtimeProtocolError:
        """Attach the client's event id when the raiser did not know it."""
        if self.related_event_id is None and isinstance(event_id, str):
            self.related_event_id = event_id
        return self
