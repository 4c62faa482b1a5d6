"""The whole 45-event server vocabulary.

25 Tier 1 events are re-exported unchanged, 8 Tier 2 classes subclass their
OpenAI twin and declare only the keys they add, and 12 Tier 3 events are ours
alone (the last, `duplex.<internal type>`, is the raw fallback).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Self

from shared.protocol.duplex.errors import error_type_for, retryable_for
from shared.protocol.realtime.errors import RealtimeProtocolError
from shared.protocol.realtime.events import (
    TIER1_EVENT_CLASSES,
    ConversationItemAdded,
    ConversationItemCreated,
    ConversationItemDeleted,
    ConversationItemDone,
    ConversationItemRetrieved,
    ConversationItemTruncated,
    ErrorEvent,
    InputAudioBufferCleared,
    InputAudioBufferCommitted,
    InputAudioBufferSpeechStarted,
    InputAudioBufferSpeechStopped,
    InputAudioBufferTimeoutTriggered,
    InputAudioTranscriptionCompleted,
    InputAudioTranscriptionDelta,
    InputAudioTranscriptionFailed,
    OutputAudioBufferCleared,
    RateLimitsUpdated,
    ResponseContentPartAdded,
    ResponseContentPartDone,
    ResponseCreated,
    ResponseDone,
    ResponseFunctionCallArgumentsDelta,
    ResponseFunctionCallArgumentsDone,
    ResponseOutputAudioDelta,
    ResponseOutputAudioDone,
    ResponseOutputAudioTranscriptDelta,
    ResponseOutputAudioTranscriptDone,
    ResponseOutputItemAdded,
    ResponseOutputItemDone,
    ResponseOutputTextDelta,
    ResponseOutputTextDone,
    SessionCreated,
    SessionUpdated,
)
from shared.protocol.realtime.wire import JSON, RealtimeEvent, WireFormatError, build_registry

#: `DuplexEvent` is the Realtime event itself: an event has no engine-internal half.
DuplexEvent = RealtimeEvent

#: Key stamped on every journaled event by the attachment journal (seq from 1).
SERVER_EVENT_SEQ_KEY = "server_event_seq"
#: Prefix of the raw fallback event type (`duplex.<internal type>`).
RAW_EVENT_PREFIX = "duplex."

# Closed vocabularies carried inside events (documented in docs/wire-api.md).
SESSION_CLOSED_REASONS = (
    "client_close",
    "disconnect",
    "timeout",
    "transport_error",
    "shutdown",
    "session_created_undelivered",
    "open_abandoned",
    "close_details_exceed_output_limit",
    "worker_lost",
)
SESSION_EXPIRED_REASONS = ("idle_ttl_expired", "disconnect_grace_expired", "request_cleanup")
RESYNC_REASONS = ("journal_gap", "journal_overflow")
OVERLAP_ACTIONS = ("drop", "listen", "barge_in")
TURN_STATES = (
    "idle",
    "user_speaking",
    "user_committed",
    "assistant_generating",
    "assistant_playing",
    "barge_in",
)
TURN_EVENTS = (
    "user_started",
    "user_committed",
    "assistant_started",
    "assistant_done",
    "barge_in",
    "playback_ack",
    "timeout",
    "close",
)
RESPONSE_STATUSES = ("in_progress", "completed", "cancelled", "failed")

# ---------------------------------------------------------------- Tier 2


@dataclasses.dataclass(kw_only=True)
class DuplexSessionCreated(SessionCreated):
    """+ `attachment_generation` and `resume_token`, only when the model can resume."""

    attachment_generation: int | None = None
    resume_token: str | None = None


@dataclasses.dataclass(kw_only=True)
class DuplexResponseCreated(ResponseCreated):
    """+ top-level `response_id`; `response.metadata.duplex_event` carries epoch and turn."""

    response_id: str | None = None


@dataclasses.dataclass(kw_only=True)
class DuplexResponseDone(ResponseDone):
    """+ top-level `response_id`; `response.status` is completed, cancelled or failed."""

    response_id: str | None = None


@dataclasses.dataclass(kw_only=True)
class DuplexOutputAudioDelta(ResponseOutputAudioDelta):
    """+ `format`, `sample_rate_hz`, `metadata` (epoch, cumulative ms, text marks, playback)."""

    format: str | None = None
    sample_rate_hz: int | None = None
    metadata: JSON | None = None


@dataclasses.dataclass(kw_only=True)
class DuplexInputAudioBufferCommitted(InputAudioBufferCommitted):
    """+ `event`: the internal `input.committed` (turn_id, epoch, history_len, ...)."""

    event: JSON | None = None


@dataclasses.dataclass(kw_only=True)
class DuplexConversationItemDeleted(ConversationItemDeleted):
    """+ `event`: the request, echoed."""

    event: JSON | None = None


@dataclasses.dataclass(kw_only=True)
class DuplexConversationItemTruncated(ConversationItemTruncated):
    """+ `event`: the request, echoed."""

    event: JSON | None = None


_ERROR_BODY_KEYS = frozenset({"type", "code", "message", "param", "event_id", "retryable"})


@dataclasses.dataclass(kw_only=True)
class DuplexErrorEvent(ErrorEvent):
    """+ `retryable` and any extra keys, merged into the `error` object."""

    retryable: bool | None = None
    extra: JSON = dataclasses.field(default_factory=dict)

    def error_body(self) -> JSON:
        body = super().error_body()
        if self.retryable is not None:
            body["retryable"] = self.retryable
        for key, value in self.extra.items():
            body.setdefault(key, value)
        return body

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        error = data.get("error")
        kwargs = cls.read_error_fields(error)  # type: ignore[arg-type]
        assert isinstance(error, Mapping)
        retryable = error.get("retryable")
        kwargs["retryable"] = retryable if isinstance(retryable, bool) else None
        kwargs["extra"] = {k: v for k, v in error.items() if k not in _ERROR_BODY_KEYS}
        if isinstance(data.get("event_id"), str):
            kwargs["event_id"] = data["event_id"]
        return cls(**kwargs)

    @classmethod
    def for_code(
        cls,
        code: str,
        message: str,
        *,
        param: str | None = None,
        related_event_id: str | None = None,
        **extra: Any,
    ) -> DuplexErrorEvent:
        """An error event whose class and retryability come from the code table."""
        return cls(
            code=code,
            message=message,
            error_type=error_type_for(code),
            param=param,
            related_event_id=related_event_id,
            retryable=retryable_for(code),
            extra=extra,
        )

    @classmethod
    def from_exception(cls, exc: RealtimeProtocolError) -> DuplexErrorEvent:
        return cls.for_code(
            exc.code,
            exc.message,
            param=exc.param,
            related_event_id=exc.related_event_id,
            **exc.extra,
        )


# ---------------------------------------------------------------- Tier 3


@dataclasses.dataclass(kw_only=True)
class SessionHeartbeatAck(RealtimeEvent):
    """Reply to `session.heartbeat` (which also refreshes the lease)."""

    TYPE = "session.heartbeat_ack"
    session_id: str


@dataclasses.dataclass(kw_only=True)
class SessionClosed(RealtimeEvent):
    """The last event on the socket, emitted only after stage cleanup."""

    TYPE = "session.closed"
    session_id: str
    reason: str
    #: the internal close event, as vLLM-Omni 0.30.0 sends it: {type, session_id, reason}
    #: at least (a worker's close adds `cleaned`)
    event: JSON | None = None

    def __post_init__(self) -> None:
        if self.event is None:
            self.event = {"type": self.TYPE, "session_id": self.session_id, "reason": self.reason}


@dataclasses.dataclass(kw_only=True)
class SessionExpired(RealtimeEvent):
    """The lease was reaped (idle TTL or disconnect grace); the socket closes after it."""

    TYPE = "session.expired"
    session_id: str
    reason: str


@dataclasses.dataclass(kw_only=True)
class SessionResumed(RealtimeEvent):
    """Resume accepted: new attachment generation and rotated token; replay follows."""

    TYPE = "session.resumed"
    session_id: str
    session: JSON
    attachment_generation: int
    resume_token: str | None = None


@dataclasses.dataclass(kw_only=True)
class SessionReplaced(RealtimeEvent):
    """Sent to a superseded socket (its own, old generation) before it is closed."""

    TYPE = "session.replaced"
    session_id: str
    attachment_generation: int


@dataclasses.dataclass(kw_only=True)
class SessionResyncRequired(RealtimeEvent):
    """Replay is impossible (journal gap or overflow): start a new session. `journal_gap`
    also when the session store went back in time (a Redis failover lost its last writes):
    a resume whose `last_received_server_event_seq` is past the journal's head, a live
    event that comes under a seq the client already has with other content, or a session
    whose whole state was lost (made in the last writes a failover lost, or kept in a Redis
    that restarted empty). A client never gets two events under one seq, nor a seq lower
    than one it has; on the openai surface the socket closes (1000,
    `session.resync_required`) instead."""

    TYPE = "session.resync_required"
    session_id: str
    reason: str


@dataclasses.dataclass(kw_only=True)
class ResponseSpeak(RealtimeEvent):
    """The model chose to speak: at most once per response, before the first audio delta."""

    TYPE = "response.speak"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    metadata: JSON | None = None


@dataclasses.dataclass(kw_only=True)
class ResponseListen(RealtimeEvent):
    """The model kept listening; with `response_id` it terminates a pre-created response."""

    TYPE = "response.listen"
    session_id: str
    epoch: int
    response_id: str | None = None
    response: JSON


@dataclasses.dataclass(kw_only=True)
class OverlapDecision(RealtimeEvent):
    """Input overlapped an active response: drop it, listen, or barge in."""

    TYPE = "overlap.decision"
    session_id: str
    epoch: int
    policy: str
    action: str
    reason: str
    metadata: JSON | None = None


@dataclasses.dataclass(kw_only=True)
class PlaybackAcknowledged(RealtimeEvent):
    """Reply to `playback.ack`: played and committed ms, truncation, history."""

    TYPE = "playback.acknowledged"
    event: JSON


@dataclasses.dataclass(kw_only=True)
class TurnEvent(RealtimeEvent):
    """An accepted turn signal, with the new turn state."""

    TYPE = "turn.event"
    session_id: str
    event: str
    turn_state: str
    epoch: int


@dataclasses.dataclass(kw_only=True)
class DuplexRawEvent(RealtimeEvent):
    """Raw fallback `duplex.<internal type>` (e.g. `duplex.function_call.done`)."""

    TYPE = RAW_EVENT_PREFIX + "<type>"
    internal_type: str
    event: JSON = dataclasses.field(default_factory=dict)

    @property
    def wire_type(self) -> str:
        return RAW_EVENT_PREFIX + self.internal_type

    def wire_body(self) -> JSON:
        return {"event": self.event}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        wire_type = data.get("type")
        if not isinstance(wire_type, str) or not wire_type.startswith(RAW_EVENT_PREFIX):
            raise WireFormatError(f"not a raw duplex event: {wire_type!r}", "type")
        event = data.get("event", {})
        if not isinstance(event, dict):
            raise WireFormatError("duplex raw event: field 'event' must be an object", "event")
        kwargs: JSON = {"internal_type": wire_type[len(RAW_EVENT_PREFIX) :], "event": event}
        if isinstance(data.get("event_id"), str):
            kwargs["event_id"] = data["event_id"]
        return cls(**kwargs)


TIER2_EVENT_CLASSES: tuple[type[RealtimeEvent], ...] = (
    DuplexSessionCreated,
    DuplexResponseCreated,
    DuplexResponseDone,
    DuplexOutputAudioDelta,
    DuplexInputAudioBufferCommitted,
    DuplexConversationItemDeleted,
    DuplexConversationItemTruncated,
    DuplexErrorEvent,
)
TIER3_EVENT_CLASSES: tuple[type[RealtimeEvent], ...] = (
    SessionHeartbeatAck,
    SessionClosed,
    SessionExpired,
    SessionResumed,
    SessionReplaced,
    SessionResyncRequired,
    ResponseSpeak,
    ResponseListen,
    OverlapDecision,
    PlaybackAcknowledged,
    TurnEvent,
    DuplexRawEvent,
)

#: wire type -> class for all 45 server event types (`duplex.<type>` for the raw fallback).
SERVER_EVENT_TYPES: dict[str, type[RealtimeEvent]] = build_registry(
    *TIER1_EVENT_CLASSES, *TIER2_EVENT_CLASSES, *TIER3_EVENT_CLASSES
)
#: tier of each registered type: 1, 2 or 3.
SERVER_EVENT_TIERS: dict[str, int] = {
    **{cls.TYPE: 1 for cls in TIER1_EVENT_CLASSES},
    **{cls.TYPE: 2 for cls in TIER2_EVENT_CLASSES},
    **{cls.TYPE: 3 for cls in TIER3_EVENT_CLASSES},
}


def server_event_class(wire_type: str) -> type[RealtimeEvent] | None:
    cls = SERVER_EVENT_TYPES.get(wire_type)
    if cls is None and wire_type.startswith(RAW_EVENT_PREFIX):
        return DuplexRawEvent
    return cls


def parse_server_event(data: Mapping[str, Any]) -> RealtimeEvent:
    """A decoded server event -> its typed class (client side). Unknown keys are
    ignored, so `server_event_seq` and keys added by newer servers do no harm;
    read the seq with `server_event_seq()`."""
    wire_type = data.get("type")
    cls = server_event_class(wire_type) if isinstance(wire_type, str) else None
    if cls is None:
        raise WireFormatError(f"unknown server event type {wire_type!r}", "type")
    return cls.from_dict(data)


def server_event_seq(data: Mapping[str, Any]) -> int | None:
    seq = data.get(SERVER_EVENT_SEQ_KEY)
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


__all__ = [
    "RAW_EVENT_PREFIX",
    "SERVER_EVENT_SEQ_KEY",
    "SERVER_EVENT_TIERS",
    "SERVER_EVENT_TYPES",
    "ConversationItemAdded",
    "ConversationItemCreated",
    "ConversationItemDone",
    "ConversationItemRetrieved",
    "DuplexConversationItemDeleted",
    "DuplexConversationItemTruncated",
    "DuplexErrorEvent",
    "DuplexEvent",
    "DuplexInputAudioBufferCommitted",
    "DuplexOutputAudioDelta",
    "DuplexRawEvent",
    "DuplexResponseCreated",
    "DuplexResponseDone",
    "DuplexSessionCreated",
    "InputAudioBufferCleared",
    "InputAudioBufferSpeechStarted",
    "InputAudioBufferSpeechStopped",
    "InputAudioBufferTimeoutTriggered",
    "InputAudioTranscriptionCompleted",
    "InputAudioTranscriptionDelta",
    "InputAudioTranscriptionFailed",
    "OutputAudioBufferCleared",
    "OverlapDecision",
    "PlaybackAcknowledged",
    "RateLimitsUpdated",
    "ResponseContentPartAdded",
    "ResponseContentPartDone",
    "ResponseFunctionCallArgumentsDelta",
    "ResponseFunctionCallArgumentsDone",
    "ResponseListen",
    "ResponseOutputAudioDone",
    "ResponseOutputAudioTranscriptDelta",
    "ResponseOutputAudioTranscriptDone",
    "ResponseOutputItemAdded",
    "ResponseOutputItemDone",
    "ResponseOutputTextDelta",
    "ResponseOutputTextDone",
    "ResponseSpeak",
    "SessionClosed",
    "SessionExpired",
    "SessionHeartbeatAck",
    "SessionReplaced",
    "SessionResumed",
    "SessionResyncRequired",
    "SessionUpdated",
    "TurnEvent",
    "parse_server_event",
    "server_event_class",
    "server_event_seq",
]
