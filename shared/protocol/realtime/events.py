"""The 30 OpenAI Realtime (GA) server events served by duplex-serve.

22 ship unchanged (Tier 1). The other 8 are the OpenAI shape of events that
`shared.protocol.duplex.events` extends with additive keys (Tier 2). Field
names and nesting follow the OpenAI GA API; nested objects stay JSON dicts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Self

from shared.protocol.realtime.errors import INVALID_REQUEST_ERROR
from shared.protocol.realtime.wire import (
    JSON,
    RealtimeEvent,
    WireFormatError,
    build_registry,
    keep_null,
)

# ---------------------------------------------------------------- session


@dataclasses.dataclass(kw_only=True)
class SessionCreated(RealtimeEvent):
    TYPE = "session.created"
    session: JSON


@dataclasses.dataclass(kw_only=True)
class SessionUpdated(RealtimeEvent):
    TYPE = "session.updated"
    session: JSON


# ---------------------------------------------------------------- input audio buffer


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferSpeechStarted(RealtimeEvent):
    TYPE = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferSpeechStopped(RealtimeEvent):
    TYPE = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferCleared(RealtimeEvent):
    TYPE = "input_audio_buffer.cleared"


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferCommitted(RealtimeEvent):
    TYPE = "input_audio_buffer.committed"
    previous_item_id: str | None = keep_null()
    item_id: str


@dataclasses.dataclass(kw_only=True)
class OutputAudioBufferCleared(RealtimeEvent):
    TYPE = "output_audio_buffer.cleared"
    response_id: str


# ---------------------------------------------------------------- conversation


@dataclasses.dataclass(kw_only=True)
class ConversationItemAdded(RealtimeEvent):
    TYPE = "conversation.item.added"
    previous_item_id: str | None = keep_null()
    item: JSON


@dataclasses.dataclass(kw_only=True)
class ConversationItemCreated(RealtimeEvent):
    """Beta spelling of `conversation.item.added`; both are always emitted."""

    TYPE = "conversation.item.created"
    previous_item_id: str | None = keep_null()
    item: JSON


@dataclasses.dataclass(kw_only=True)
class ConversationItemDone(RealtimeEvent):
    TYPE = "conversation.item.done"
    previous_item_id: str | None = keep_null()
    item: JSON


@dataclasses.dataclass(kw_only=True)
class ConversationItemRetrieved(RealtimeEvent):
    TYPE = "conversation.item.retrieved"
    item: JSON


@dataclasses.dataclass(kw_only=True)
class ConversationItemDeleted(RealtimeEvent):
    TYPE = "conversation.item.deleted"
    item_id: str


@dataclasses.dataclass(kw_only=True)
class ConversationItemTruncated(RealtimeEvent):
    TYPE = "conversation.item.truncated"
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclasses.dataclass(kw_only=True)
class InputAudioTranscriptionCompleted(RealtimeEvent):
    TYPE = "conversation.item.input_audio_transcription.completed"
    item_id: str
    content_index: int
    transcript: str


# ---------------------------------------------------------------- response lifecycle


@dataclasses.dataclass(kw_only=True)
class ResponseCreated(RealtimeEvent):
    TYPE = "response.created"
    response: JSON


@dataclasses.dataclass(kw_only=True)
class ResponseDone(RealtimeEvent):
    TYPE = "response.done"
    response: JSON


@dataclasses.dataclass(kw_only=True)
class ResponseOutputItemAdded(RealtimeEvent):
    TYPE = "response.output_item.added"
    response_id: str
    output_index: int
    item: JSON


@dataclasses.dataclass(kw_only=True)
class ResponseOutputItemDone(RealtimeEvent):
    TYPE = "response.output_item.done"
    response_id: str
    output_index: int
    item: JSON


@dataclasses.dataclass(kw_only=True)
class _ContentScoped(RealtimeEvent):
    """Shared keys of the events that address one content part of one item."""

    response_id: str
    item_id: str
    output_index: int
    content_index: int


@dataclasses.dataclass(kw_only=True)
class ResponseContentPartAdded(_ContentScoped):
    TYPE = "response.content_part.added"
    part: JSON


@dataclasses.dataclass(kw_only=True)
class ResponseContentPartDone(_ContentScoped):
    TYPE = "response.content_part.done"
    part: JSON


@dataclasses.dataclass(kw_only=True)
class ResponseOutputAudioDelta(_ContentScoped):
    TYPE = "response.output_audio.delta"
    delta: str


@dataclasses.dataclass(kw_only=True)
class ResponseOutputAudioDone(_ContentScoped):
    TYPE = "response.output_audio.done"


@dataclasses.dataclass(kw_only=True)
class ResponseOutputAudioTranscriptDelta(_ContentScoped):
    TYPE = "response.output_audio_transcript.delta"
    delta: str


@dataclasses.dataclass(kw_only=True)
class ResponseOutputAudioTranscriptDone(_ContentScoped):
    TYPE = "response.output_audio_transcript.done"
    transcript: str


@dataclasses.dataclass(kw_only=True)
class ResponseOutputTextDelta(_ContentScoped):
    TYPE = "response.output_text.delta"
    delta: str


@dataclasses.dataclass(kw_only=True)
class ResponseOutputTextDone(_ContentScoped):
    TYPE = "response.output_text.done"
    text: str


@dataclasses.dataclass(kw_only=True)
class ResponseFunctionCallArgumentsDelta(RealtimeEvent):
    TYPE = "response.function_call_arguments.delta"
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    delta: str


@dataclasses.dataclass(kw_only=True)
class ResponseFunctionCallArgumentsDone(RealtimeEvent):
    TYPE = "response.function_call_arguments.done"
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    arguments: str
    name: str | None = None


@dataclasses.dataclass(kw_only=True)
class RateLimitsUpdated(RealtimeEvent):
    """Always `rate_limits: []` here: we do not meter tokens per session."""

    TYPE = "rate_limits.updated"
    rate_limits: list[Any] = dataclasses.field(default_factory=list)


# ---------------------------------------------------------------- error


@dataclasses.dataclass(kw_only=True)
class ErrorEvent(RealtimeEvent):
    """`{"type":"error","event_id":…,"error":{type, code, message, param?, event_id?}}`.

    Python fields are flat; the wire nests them under `error`. The client's
    event id is `related_event_id` here and `error.event_id` on the wire.
    """

    TYPE = "error"
    code: str | None = None
    message: str = ""
    error_type: str = INVALID_REQUEST_ERROR
    param: str | None = None
    related_event_id: str | None = None

    def error_body(self) -> JSON:
        body: JSON = {"type": self.error_type, "code": self.code, "message": self.message}
        if self.param is not None:
            body["param"] = self.param
        if self.related_event_id is not None:
            body["event_id"] = self.related_event_id
        return body

    def wire_body(self) -> JSON:
        return {"error": self.error_body()}

    @classmethod
    def read_error_fields(cls, error: Mapping[str, Any]) -> JSON:
        if not isinstance(error, Mapping):
            raise WireFormatError("error: field 'error' must be an object")
        kwargs: JSON = {
            "code": error.get("code"),
            "message": str(error.get("message", "")),
            "error_type": str(error.get("type", INVALID_REQUEST_ERROR)),
            "param": error.get("param"),
            "related_event_id": error.get("event_id"),
        }
        return kwargs

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        kwargs = cls.read_error_fields(data.get("error"))  # type: ignore[arg-type]
        if isinstance(data.get("event_id"), str):
            kwargs["event_id"] = data["event_id"]
        return cls(**kwargs)


#: OpenAI's events that ship exactly as OpenAI defines them (Tier 1).
TIER1_EVENT_CLASSES: tuple[type[RealtimeEvent], ...] = (
    SessionUpdated,
    InputAudioBufferSpeechStarted,
    InputAudioBufferSpeechStopped,
    InputAudioBufferCleared,
    ConversationItemAdded,
    ConversationItemCreated,
    ConversationItemDone,
    ConversationItemRetrieved,
    InputAudioTranscriptionCompleted,
    ResponseOutputItemAdded,
    ResponseOutputItemDone,
    ResponseContentPartAdded,
    ResponseContentPartDone,
    ResponseOutputAudioDone,
    ResponseOutputAudioTranscriptDelta,
    ResponseOutputAudioTranscriptDone,
    ResponseOutputTextDelta,
    ResponseOutputTextDone,
    ResponseFunctionCallArgumentsDelta,
    ResponseFunctionCallArgumentsDone,
    RateLimitsUpdated,
    OutputAudioBufferCleared,
)

#: OpenAI's shape of the events that the duplex layer extends (Tier 2 bases).
EXTENDED_EVENT_CLASSES: tuple[type[RealtimeEvent], ...] = (
    SessionCreated,
    ResponseCreated,
    ResponseDone,
    ResponseOutputAudioDelta,
    InputAudioBufferCommitted,
    ConversationItemDeleted,
    ConversationItemTruncated,
    ErrorEvent,
)

#: wire type -> class for the 30 OpenAI server events.
REALTIME_SERVER_EVENTS: dict[str, type[RealtimeEvent]] = build_registry(
    *TIER1_EVENT_CLASSES, *EXTENDED_EVENT_CLASSES
)
