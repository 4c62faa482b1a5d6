"""The 33 OpenAI Realtime (GA) server events served by duplex-serve.

25 ship unchanged (Tier 1). The other 8 are the OpenAI shape of events that
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
    """The session exists; first event on the socket (not journaled, no seq)."""

    TYPE = "session.created"
    session: JSON


@dataclasses.dataclass(kw_only=True)
class SessionUpdated(RealtimeEvent):
    """After the first `session.created` and after every accepted `session.update`."""

    TYPE = "session.updated"
    session: JSON


# ---------------------------------------------------------------- input audio buffer


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferSpeechStarted(RealtimeEvent):
    """Speech onset (server VAD, client hint, or RMS heuristic)."""

    TYPE = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferSpeechStopped(RealtimeEvent):
    """Speech end; also precedes the commit fan-out."""

    TYPE = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferCleared(RealtimeEvent):
    """After `input_audio_buffer.clear` or `input.cancel`."""

    TYPE = "input_audio_buffer.cleared"


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferTimeoutTriggered(RealtimeEvent):
    """Server VAD's `idle_timeout_ms` passed without speech after the last response's
    audio; the (silent) buffer is committed and a response created next."""

    TYPE = "input_audio_buffer.timeout_triggered"
    audio_start_ms: int
    audio_end_ms: int
    item_id: str


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferCommitted(RealtimeEvent):
    """A user turn was committed to the conversation."""

    TYPE = "input_audio_buffer.committed"
    previous_item_id: str | None = keep_null()
    item_id: str


@dataclasses.dataclass(kw_only=True)
class OutputAudioBufferCleared(RealtimeEvent):
    """Reply to `output_audio_buffer.clear`."""

    TYPE = "output_audio_buffer.cleared"
    response_id: str


# ---------------------------------------------------------------- conversation


@dataclasses.dataclass(kw_only=True)
class ConversationItemAdded(RealtimeEvent):
    """An item entered history (GA spelling)."""

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
    """An item was finalised."""

    TYPE = "conversation.item.done"
    previous_item_id: str | None = keep_null()
    item: JSON


@dataclasses.dataclass(kw_only=True)
class ConversationItemRetrieved(RealtimeEvent):
    """Reply to `conversation.item.retrieve`."""

    TYPE = "conversation.item.retrieved"
    item: JSON


@dataclasses.dataclass(kw_only=True)
class ConversationItemDeleted(RealtimeEvent):
    """Reply to `conversation.item.delete`."""

    TYPE = "conversation.item.deleted"
    item_id: str


@dataclasses.dataclass(kw_only=True)
class ConversationItemTruncated(RealtimeEvent):
    """Reply to `conversation.item.truncate`."""

    TYPE = "conversation.item.truncated"
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclasses.dataclass(kw_only=True)
class InputAudioTranscriptionCompleted(RealtimeEvent):
    """The user's transcript of a committed item, by the model's recogniser.

    `usage` is GA's duration form, `{type: "duration", seconds}`: the item's audio."""

    TYPE = "conversation.item.input_audio_transcription.completed"
    item_id: str
    content_index: int
    transcript: str
    usage: JSON | None = None


@dataclasses.dataclass(kw_only=True)
class InputAudioTranscriptionDelta(RealtimeEvent):
    """New words of the transcript of the turn the user is speaking (partial recognition).

    `delta` is incremental: the deltas of an item, joined, are the stable words heard so
    far; `.completed` carries the final transcript."""

    TYPE = "conversation.item.input_audio_transcription.delta"
    item_id: str
    content_index: int | None = None
    delta: str | None = None


@dataclasses.dataclass(kw_only=True)
class InputAudioTranscriptionFailed(RealtimeEvent):
    """The recogniser failed on a committed item (`error`: type, code, message); the
    item is committed without a transcript and the session goes on."""

    TYPE = "conversation.item.input_audio_transcription.failed"
    item_id: str
    content_index: int
    error: JSON


# ---------------------------------------------------------------- response lifecycle


@dataclasses.dataclass(kw_only=True)
class ResponseCreated(RealtimeEvent):
    """A response started."""

    TYPE = "response.created"
    response: JSON


@dataclasses.dataclass(kw_only=True)
class ResponseDone(RealtimeEvent):
    """A response ended: completed, cancelled or failed."""

    TYPE = "response.done"
    response: JSON


@dataclasses.dataclass(kw_only=True)
class ResponseOutputItemAdded(RealtimeEvent):
    """An assistant (or function_call) item was attached to the response."""

    TYPE = "response.output_item.added"
    response_id: str
    output_index: int
    item: JSON


@dataclasses.dataclass(kw_only=True)
class ResponseOutputItemDone(RealtimeEvent):
    """An output item was finalised."""

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
    """An audio or text part was opened."""

    TYPE = "response.content_part.added"
    part: JSON


@dataclasses.dataclass(kw_only=True)
class ResponseContentPartDone(_ContentScoped):
    """A content part was finalised."""

    TYPE = "response.content_part.done"
    part: JSON


@dataclasses.dataclass(kw_only=True)
class ResponseOutputAudioDelta(_ContentScoped):
    """A chunk of model audio (base64 in the session's output format)."""

    TYPE = "response.output_audio.delta"
    delta: str


@dataclasses.dataclass(kw_only=True)
class ResponseOutputAudioDone(_ContentScoped):
    """The response's audio stream closed."""

    TYPE = "response.output_audio.done"


@dataclasses.dataclass(kw_only=True)
class ResponseOutputAudioTranscriptDelta(_ContentScoped):
    """Transcript of the audio: exactly one per audio delta."""

    TYPE = "response.output_audio_transcript.delta"
    delta: str


@dataclasses.dataclass(kw_only=True)
class ResponseOutputAudioTranscriptDone(_ContentScoped):
    """The full transcript of the response's audio."""

    TYPE = "response.output_audio_transcript.done"
    transcript: str


@dataclasses.dataclass(kw_only=True)
class ResponseOutputTextDelta(_ContentScoped):
    """Text output (text modality)."""

    TYPE = "response.output_text.delta"
    delta: str


@dataclasses.dataclass(kw_only=True)
class ResponseOutputTextDone(_ContentScoped):
    """The full text output."""

    TYPE = "response.output_text.done"
    text: str


@dataclasses.dataclass(kw_only=True)
class ResponseFunctionCallArgumentsDelta(RealtimeEvent):
    """Streaming tool-call arguments."""

    TYPE = "response.function_call_arguments.delta"
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    delta: str


@dataclasses.dataclass(kw_only=True)
class ResponseFunctionCallArgumentsDone(RealtimeEvent):
    """Complete tool-call arguments."""

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
    InputAudioTranscriptionDelta,
    InputAudioTranscriptionFailed,
    InputAudioBufferTimeoutTriggered,
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

#: wire type -> class for the 33 OpenAI server events.
REALTIME_SERVER_EVENTS: dict[str, type[RealtimeEvent]] = build_registry(
    *TIER1_EVENT_CLASSES, *EXTENDED_EVENT_CLASSES
)
