"""The whole client vocabulary: 17 commands, 3 envelope-only events, and aliases.

8 Tier 1 commands are re-exported, 2 Tier 2 commands subclass their OpenAI
twin (append + format/hints/video, commit + final/create_response/is_speech),
and 7 Tier 3 commands are ours. `parse_client_event` is the one function that
turns a client frame into a typed command or envelope event.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Mapping
from typing import Any, Self

from shared.protocol.realtime.audio import is_wav
from shared.protocol.realtime.commands import (
    DEFAULT_CONTEXT,
    TIER1_COMMAND_CLASSES,
    CancelResponse,
    ClearInput,
    ClearOutputAudio,
    CommandContext,
    CreateItem,
    CreateResponse,
    DeleteItem,
    InputAudioBufferAppend,
    InputAudioBufferCommit,
    RealtimeCommand,
    TruncateItem,
    UpdateSession,
    client_event_id,
    optional_object,
    read_typed,
    require_item_id,
    require_number,
)
from shared.protocol.realtime.envelope import decode_client_frame
from shared.protocol.realtime.errors import RealtimeProtocolError
from shared.protocol.realtime.formats import AudioFormat, parse_audio_format, validate_rate
from shared.protocol.realtime.wire import JSON, build_registry

#: Client frames over this many UTF-8 bytes are refused with `event_too_large`.
MAX_EVENT_BYTES = 15 * 1024 * 1024

#: Hint keys an append may carry (top level or under `hints`); copied through.
REALTIME_INPUT_HINT_KEYS = (
    "duration_ms",
    "audio_duration_ms",
    "audio_start_ms",
    "audio_end_ms",
    "is_speech",
    "speech",
    "speech_probability",
    "vad",
    "overlap_action",
    "overlap",
    "force_barge_in",
    "force_listen",
    "text",
    "transcript",
    "max_slice_nums",
)
_SAMPLE_WIDTH = {"pcm16": 2, "pcm_f32le": 4}
# Hints that AppendAudio promotes to typed fields.
_TYPED_HINTS = frozenset({"is_speech", "duration_ms", "audio_end_ms"})

#: `DuplexCommand` is the base of every command a session's mailbox receives.
DuplexCommand = RealtimeCommand


def _optional_bool(data: Mapping[str, Any], *keys: str) -> bool | None:
    for key in keys:
        if key in data and data[key] is not None:
            if not isinstance(data[key], bool):
                raise RealtimeProtocolError("bad_event", f"{key} must be a boolean", param=key)
            return data[key]
    return None


def _optional_str(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise RealtimeProtocolError("bad_event", f"{key} must be a string", param=key)
    return value


def _strip_data_url(frame: str) -> str:
    """`data:image/jpeg;base64,XXXX` -> `XXXX` (bare base64 is what the model takes)."""
    if frame.startswith("data:") and "," in frame:
        return frame.split(",", 1)[1]
    return frame


def _read_video_frames(data: Mapping[str, Any]) -> tuple[str, ...]:
    frames = data.get("video_frames")
    if frames is None:
        return ()
    if not isinstance(frames, list) or not all(isinstance(f, str) for f in frames):
        raise RealtimeProtocolError(
            "invalid_video_frames",
            "video_frames must be a list of base64 strings",
            param="video_frames",
        )
    out = []
    for index, frame in enumerate(frames):
        bare = _strip_data_url(frame)
        try:
            base64.b64decode(bare, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeProtocolError(
                "invalid_video_frames",
                f"video frame {index} is not valid base64",
                param=f"video_frames[{index}]",
            ) from None
        out.append(bare)
    return tuple(out)


# ---------------------------------------------------------------- Tier 2

#: an append's fields as they cross from the API pod to the worker, in this order
#: (`AppendAudio.inbox_fields`); its audio travels raw beside them
INBOX_FIELDS = (
    "event_id",
    "format",
    "sample_rate_hz",
    "is_speech",
    "duration_ms",
    "audio_end_ms",
    "video_frames",
    "hints",
)


@dataclasses.dataclass(kw_only=True)
class AppendAudio(InputAudioBufferAppend):
    """`input_audio_buffer.append` + format, speech hints and camera frames.

    `format`/`sample_rate_hz` are always the effective ones: what the append
    declared, else the session's declared input defaults.
    """

    format: str = "pcm16"
    sample_rate_hz: int = 16_000
    is_speech: bool | None = None
    video_frames: tuple[str, ...] = ()
    duration_ms: int | float | None = None
    audio_end_ms: int | float | None = None
    hints: JSON = dataclasses.field(default_factory=dict)

    @property
    def audio_format(self) -> AudioFormat:
        return AudioFormat(self.format, self.sample_rate_hz)

    def wire_body(self) -> JSON:
        body = super().wire_body()
        body["format"] = self.format
        body["sample_rate_hz"] = self.sample_rate_hz
        for key in ("is_speech", "duration_ms", "audio_end_ms"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.video_frames:
            body["video_frames"] = list(self.video_frames)
        if self.hints:
            body["hints"] = self.hints
        return body

    def inbox_fields(self) -> list[Any]:
        """Its validated fields but the audio, in `INBOX_FIELDS` order, as they cross to the
        worker (shared/redis/inbox_codec.py); trailing defaults are left out."""
        values = [
            self.event_id,
            self.format,
            self.sample_rate_hz,
            self.is_speech,
            self.duration_ms,
            self.audio_end_ms,
            list(self.video_frames),
            self.hints,
        ]
        size = len(values)
        while size > 3 and values[size - 1] in (None, [], {}):
            size -= 1
        return values[:size]

    @classmethod
    def from_inbox_fields(cls, values: list[Any], audio: bytes) -> Self:
        """The append `inbox_fields` wrote, built as it was validated: nothing is checked
        again (the API pod did), no JSON or base64 is decoded."""
        if not 3 <= len(values) <= len(INBOX_FIELDS):
            raise ValueError(f"an append's inbox fields are {len(values)} values")
        named = dict(zip(INBOX_FIELDS, values, strict=False))
        if "video_frames" in named:
            named["video_frames"] = tuple(named["video_frames"] or ())
        if named.get("hints") is None:
            named.pop("hints", None)
        return cls(audio=audio, **named)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        default = ctx.defaults.input_format
        declared = data.get("format", data.get("input_audio_format"))
        rate = data.get("sample_rate_hz", data.get("sample_rate"))
        if declared is None:
            fmt = default if rate is None else AudioFormat(default.encoding, validate_rate(rate))
        else:
            fmt = parse_audio_format(declared, rate=rate, param="format", fallback=default)
        audio = cls.read_audio(data)  # format is checked first: a bad format wins over bad audio
        width = _SAMPLE_WIDTH.get(fmt.encoding, 1)
        if len(audio) % width and not is_wav(audio):
            raise RealtimeProtocolError(
                "bad_audio",
                f"{fmt.encoding} audio must be a whole number of {width}-byte samples",
                param="audio",
            )
        hints_obj = optional_object(data, "hints") or {}
        hints = {
            k: data[k] for k in REALTIME_INPUT_HINT_KEYS if k in data and k not in _TYPED_HINTS
        }
        hints.update({k: v for k, v in hints_obj.items() if k not in _TYPED_HINTS})
        merged = {**hints_obj, **data}
        return cls(
            event_id=client_event_id(data),
            audio=audio,
            format=fmt.encoding,
            sample_rate_hz=fmt.rate or 0,
            is_speech=_optional_bool(merged, "is_speech"),
            video_frames=_read_video_frames(data),
            duration_ms=require_number(merged, "duration_ms", required=False),
            audio_end_ms=require_number(merged, "audio_end_ms", required=False),
            hints=hints,
        )


@dataclasses.dataclass(kw_only=True)
class Commit(InputAudioBufferCommit):
    """`input_audio_buffer.commit` + `final`, tri-state `create_response`, `is_speech`.

    `create_response=None` lets the runner decide; `is_speech=False` declares
    silence (answered with `response.listen`).
    """

    final: bool = True
    create_response: bool | None = None
    is_speech: bool | None = None

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        final = _optional_bool(data, "final")
        return cls(
            event_id=client_event_id(data),
            final=True if final is None else final,
            create_response=_optional_bool(data, "create_response", "response_create"),
            is_speech=_optional_bool(data, "is_speech"),
        )


# ---------------------------------------------------------------- Tier 3


@dataclasses.dataclass(kw_only=True)
class AppendText(RealtimeCommand):
    """Model-native sessions reject it with `native_text_append_unsupported`."""

    TYPE = "input.text.append"
    text: str


@dataclasses.dataclass(kw_only=True)
class CancelInput(RealtimeCommand):
    """Advances the epoch; answered with `input_audio_buffer.cleared`."""

    TYPE = "input.cancel"


@dataclasses.dataclass(kw_only=True)
class BargeIn(RealtimeCommand):
    """Hard interrupt (needs `supports_barge_in`); advances the epoch."""

    TYPE = "barge_in"


#: `turn.signal` events that are really another command, re-mapped to it.
TURN_SIGNAL_REMAPS = (
    "input.cancel",
    "barge_in",
    "response.cancel",
    "session.update",
    "conversation.item.create",
    "conversation.item.delete",
    "conversation.item.truncate",
)


@dataclasses.dataclass(kw_only=True)
class SignalTurn(RealtimeCommand):
    """A turn signal (`event` + `payload`); some events are re-mapped to their command."""

    TYPE = "turn.signal"
    event: str
    payload: JSON = dataclasses.field(default_factory=dict)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Any:
        fields = read_typed(cls, data)
        if fields["event"] in TURN_SIGNAL_REMAPS:
            target = DUPLEX_COMMANDS[fields["event"]]
            payload = {**fields.get("payload", {}), "type": fields["event"]}
            if "event_id" in data:
                payload["event_id"] = data["event_id"]
            return target.from_wire(payload, ctx)
        return cls(event_id=client_event_id(data), **fields)


@dataclasses.dataclass(kw_only=True)
class AckPlayback(RealtimeCommand):
    """What the client actually played (`played_ms`), and optionally what it commits."""

    TYPE = "playback.ack"
    played_ms: int | float
    committed_ms: int | float | None = None
    response_id: str | None = None
    item_id: str | None = None
    truncate: bool = False

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        return cls(
            event_id=client_event_id(data),
            played_ms=require_number(data, "played_ms"),  # type: ignore[arg-type]
            committed_ms=require_number(data, "committed_ms", required=False),
            response_id=_optional_str(data, "response_id"),
            item_id=_optional_str(data, "item_id"),
            truncate=bool(_optional_bool(data, "truncate")),
        )


@dataclasses.dataclass(kw_only=True)
class Heartbeat(RealtimeCommand):
    """Refreshes the lease; answered with `session.heartbeat_ack`."""

    TYPE = "session.heartbeat"


@dataclasses.dataclass(kw_only=True)
class CloseSession(RealtimeCommand):
    """Close the session; `session.closed` (after cleanup) is the last event."""

    TYPE = "session.close"
    reason: str = "client_close"


TIER2_COMMAND_CLASSES: tuple[type[RealtimeCommand], ...] = (AppendAudio, Commit)
TIER3_COMMAND_CLASSES: tuple[type[RealtimeCommand], ...] = (
    AppendText,
    CancelInput,
    BargeIn,
    SignalTurn,
    AckPlayback,
    Heartbeat,
    CloseSession,
)

#: wire type -> class for the 17 client commands a session receives.
DUPLEX_COMMANDS: dict[str, type[RealtimeCommand]] = build_registry(
    *TIER1_COMMAND_CLASSES, *TIER2_COMMAND_CLASSES, *TIER3_COMMAND_CLASSES
)
CLIENT_COMMAND_TYPES = DUPLEX_COMMANDS
CLIENT_COMMAND_TIERS: dict[str, int] = {
    **{cls.TYPE: 1 for cls in TIER1_COMMAND_CLASSES},
    **{cls.TYPE: 2 for cls in TIER2_COMMAND_CLASSES},
    **{cls.TYPE: 3 for cls in TIER3_COMMAND_CLASSES},
}

# ---------------------------------------------------------------- other surfaces' commands


@dataclasses.dataclass(kw_only=True)
class MuteInput(RealtimeCommand):
    """GPT-Live's `session.input_audio.mute` / `unmute` (services/api/live_sessions.py):
    while `muted`, the session's model hears silence in place of the client's audio, and
    goes on speaking. Kept with the session on its worker (it moves with it); answered with
    `session.input_audio.muted` / `unmuted`. Not a duplex-surface command: only the API pod
    of that surface builds it."""

    TYPE = "session.input_audio.mute"
    muted: bool = True


#: wire type -> class for the commands only another surface's API pod sends (never parsed
#: from a duplex or openai client's frame); they cross the inbox like the others
SURFACE_COMMANDS: dict[str, type[RealtimeCommand]] = build_registry(MuteInput)

# ---------------------------------------------------------------- envelope-only


@dataclasses.dataclass(kw_only=True)
class EnvelopeEvent(RealtimeCommand):
    """A client event the transport handles itself; never reaches a session."""


@dataclasses.dataclass(kw_only=True)
class SessionResume(EnvelopeEvent):
    """Valid only as the first message on a socket (else `unsupported_session_resume`)."""

    TYPE = "session.resume"
    session_id: str
    resume_token: str
    last_received_server_event_seq: int = 0

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        session_id, token = data.get("session_id"), data.get("resume_token")
        seq = data.get("last_received_server_event_seq", 0)
        if not isinstance(session_id, str) or not session_id:
            raise RealtimeProtocolError(
                "invalid_session_resume", "session_id is required", param="session_id"
            )
        if not isinstance(token, str) or not token:
            raise RealtimeProtocolError(
                "invalid_session_resume", "resume_token is required", param="resume_token"
            )
        if seq is None:
            seq = 0
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise RealtimeProtocolError(
                "invalid_session_resume",
                "last_received_server_event_seq must be an integer >= 0",
                param="last_received_server_event_seq",
            )
        return cls(
            event_id=client_event_id(data),
            session_id=session_id,
            resume_token=token,
            last_received_server_event_seq=seq,
        )


@dataclasses.dataclass(kw_only=True)
class SessionEventAck(EnvelopeEvent):
    """Lets the server trim its replay journal up to and including `server_event_seq`."""

    TYPE = "session.event_ack"
    server_event_seq: int

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        seq = data.get("server_event_seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise RealtimeProtocolError(
                "invalid_event_ack",
                "server_event_seq must be an integer >= 0",
                param="server_event_seq",
            )
        return cls(event_id=client_event_id(data), server_event_seq=seq)


@dataclasses.dataclass(kw_only=True)
class ConversationItemRetrieve(EnvelopeEvent):
    """`conversation.item.retrieve{item_id}`, handed to the session as a SignalTurn."""

    TYPE = "conversation.item.retrieve"
    item_id: str

    def to_command(self) -> SignalTurn:
        return SignalTurn(
            event_id=self.event_id, event=self.TYPE, payload={"item_id": self.item_id}
        )

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        return cls(event_id=client_event_id(data), item_id=require_item_id(data))


ENVELOPE_EVENT_TYPES: dict[str, type[EnvelopeEvent]] = build_registry(
    SessionResume, SessionEventAck, ConversationItemRetrieve
)

#: alias -> canonical wire type. `input.commit` also defaults create_response to True.
CLIENT_EVENT_ALIASES: dict[str, str] = {
    "input.commit": "input_audio_buffer.commit",
    "audio.playback_ack": "playback.ack",
    "close": "session.close",
    "close_session": "session.close",
    "input_text.append": "input.text.append",
    "push_text": "input.text.append",
    "signal_turn": "turn.signal",
}

ClientEvent = RealtimeCommand  # a command, or an envelope-only event


def parse_client_event(
    frame: str | bytes | Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT
) -> RealtimeCommand:
    """One client frame (or its decoded object) -> a typed command or envelope event.

    Raises `RealtimeProtocolError` with the contract's code, carrying the
    client's `event_id` whenever the frame got far enough to have one.
    `conversation.item.retrieve` comes back as its SignalTurn.
    """
    data = (
        frame
        if isinstance(frame, Mapping)
        else decode_client_frame(frame, max_bytes=MAX_EVENT_BYTES)
    )
    event_id = client_event_id(data)
    wire_type = data.get("type")
    if not isinstance(wire_type, str) or not wire_type:
        raise RealtimeProtocolError(
            "bad_event",
            "client event needs a string 'type'",
            param="type",
            related_event_id=event_id,
        )
    canonical = CLIENT_EVENT_ALIASES.get(wire_type, wire_type)
    if (
        wire_type == "input.commit"
        and "create_response" not in data
        and "response_create" not in data
    ):
        data = {**data, "create_response": True}
    try:
        if canonical in ENVELOPE_EVENT_TYPES:
            event = ENVELOPE_EVENT_TYPES[canonical].from_wire(data, ctx)
            return event.to_command() if isinstance(event, ConversationItemRetrieve) else event
        cls = DUPLEX_COMMANDS.get(canonical)
        if cls is None:
            raise RealtimeProtocolError(
                "unknown_event", f"unknown client event type {wire_type!r}", param="type"
            )
        return cls.from_wire(data, ctx)
    except RealtimeProtocolError as exc:
        raise exc.with_event_id(event_id) from None


__all__ = [
    "CLIENT_COMMAND_TIERS",
    "CLIENT_COMMAND_TYPES",
    "CLIENT_EVENT_ALIASES",
    "DUPLEX_COMMANDS",
    "ENVELOPE_EVENT_TYPES",
    "MAX_EVENT_BYTES",
    "REALTIME_INPUT_HINT_KEYS",
    "SURFACE_COMMANDS",
    "TURN_SIGNAL_REMAPS",
    "AckPlayback",
    "AppendAudio",
    "AppendText",
    "BargeIn",
    "CancelInput",
    "CancelResponse",
    "ClearInput",
    "ClearOutputAudio",
    "ClientEvent",
    "CloseSession",
    "CommandContext",
    "Commit",
    "ConversationItemRetrieve",
    "CreateItem",
    "CreateResponse",
    "DeleteItem",
    "DuplexCommand",
    "EnvelopeEvent",
    "Heartbeat",
    "InputAudioBufferAppend",
    "MuteInput",
    "SessionEventAck",
    "SessionResume",
    "SignalTurn",
    "TruncateItem",
    "UpdateSession",
    "parse_client_event",
]
