"""The 10 OpenAI Realtime client commands: wire type + typed fields.

8 ship as they are (Tier 1); `input_audio_buffer.append` and
`input_audio_buffer.commit` are the OpenAI shape of the two commands that
`shared.protocol.duplex.commands` extends (Tier 2). Parsing validates and
raises `RealtimeProtocolError` with the contract's codes; rendering is the
canonical wire JSON, so parse -> render -> parse is the identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Self

from shared.protocol.realtime.audio import b64decode_audio, b64encode_audio
from shared.protocol.realtime.errors import RealtimeProtocolError
from shared.protocol.realtime.items import normalize_item
from shared.protocol.realtime.session import InputAudioDefaults
from shared.protocol.realtime.wire import JSON, WireFormatError, WireMessage, build_registry, dumps

_ENVELOPE_KEYS = ("type", "event_id")


@dataclasses.dataclass(frozen=True)
class CommandContext:
    """What parsing needs to know about the session: its declared audio defaults."""

    defaults: InputAudioDefaults = InputAudioDefaults()


DEFAULT_CONTEXT = CommandContext()


@dataclasses.dataclass(kw_only=True)
class RealtimeCommand(WireMessage):
    """A typed client command. `event_id` is the client's own id, if it sent one."""

    event_id: str | None = None

    def to_dict(self) -> JSON:
        out: JSON = {"type": self.wire_type}
        if self.event_id is not None:
            out["event_id"] = self.event_id
        out.update(self.wire_body())
        return out

    def to_json(self) -> bytes:
        return dumps(self.to_dict())

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        """Parse a decoded client event of this type (typed fields; unknown keys ignored)."""
        return cls(event_id=client_event_id(data), **read_typed(cls, data))


def client_event_id(data: Mapping[str, Any]) -> str | None:
    value = data.get("event_id")
    return value if isinstance(value, str) else None


def read_typed(cls: type[WireMessage], data: Mapping[str, Any]) -> JSON:
    """`cls.read_fields`, with shape errors reported as `bad_event` naming the field."""
    try:
        return cls.read_fields(data)
    except WireFormatError as exc:
        raise RealtimeProtocolError("bad_event", str(exc), param=exc.param) from None


def optional_object(data: Mapping[str, Any], key: str) -> JSON | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RealtimeProtocolError("bad_event", f"{key!r} must be an object", param=key)
    return dict(value)


# ---------------------------------------------------------------- Tier 1


@dataclasses.dataclass(kw_only=True)
class UpdateSession(RealtimeCommand):
    """`session.update`: `patch` is the session object (or the payload itself without one)."""

    TYPE = "session.update"
    patch: JSON = dataclasses.field(default_factory=dict)

    def wire_body(self) -> JSON:
        return {"session": self.patch}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        patch = optional_object(data, "session")
        if patch is None:
            patch = {k: v for k, v in data.items() if k not in _ENVELOPE_KEYS}
        return cls(event_id=client_event_id(data), patch=patch)


@dataclasses.dataclass(kw_only=True)
class ClearInput(RealtimeCommand):
    """Drop buffered input audio; answered with `input_audio_buffer.cleared`."""

    TYPE = "input_audio_buffer.clear"


@dataclasses.dataclass(kw_only=True)
class ClearOutputAudio(RealtimeCommand):
    """Advances the epoch. WebRTC-only at OpenAI; usable over WebSocket here."""

    TYPE = "output_audio_buffer.clear"
    response_id: str | None = None


@dataclasses.dataclass(kw_only=True)
class CreateResponse(RealtimeCommand):
    """Ask for a response; `response` holds per-response options."""

    TYPE = "response.create"
    options: JSON = dataclasses.field(default_factory=dict)

    def wire_body(self) -> JSON:
        return {"response": self.options}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        return cls(event_id=client_event_id(data), options=optional_object(data, "response") or {})


@dataclasses.dataclass(kw_only=True)
class CancelResponse(RealtimeCommand):
    """Advances the epoch; without `response_id` it cancels the active response."""

    TYPE = "response.cancel"
    response_id: str | None = None


@dataclasses.dataclass(kw_only=True)
class CreateItem(RealtimeCommand):
    """Add an item to the conversation history."""

    TYPE = "conversation.item.create"
    item: JSON
    previous_item_id: str | None = None

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        if "item" not in data:
            raise RealtimeProtocolError(
                "bad_event", "conversation.item.create needs an item", param="item"
            )
        previous = data.get("previous_item_id")
        if previous is not None and not isinstance(previous, str):
            raise RealtimeProtocolError(
                "bad_event", "previous_item_id must be a string", param="previous_item_id"
            )
        return cls(
            event_id=client_event_id(data),
            item=normalize_item(data["item"]),
            previous_item_id=previous,
        )


def require_item_id(data: Mapping[str, Any]) -> str:
    item_id = data.get("item_id")
    if not isinstance(item_id, str) or not item_id:
        raise RealtimeProtocolError("missing_item_id", "item_id is required", param="item_id")
    return item_id


def require_number(
    data: Mapping[str, Any], key: str, *, required: bool = True
) -> int | float | None:
    """A numeric field >= 0 (`bad_event` naming the field otherwise)."""
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise RealtimeProtocolError("bad_event", f"{key} must be a number >= 0", param=key)
    return value


@dataclasses.dataclass(kw_only=True)
class DeleteItem(RealtimeCommand):
    """Remove an item from history (`missing_item_id` without `item_id`)."""

    TYPE = "conversation.item.delete"
    item_id: str

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        return cls(event_id=client_event_id(data), item_id=require_item_id(data))


@dataclasses.dataclass(kw_only=True)
class TruncateItem(RealtimeCommand):
    """Cut an assistant audio item at `audio_end_ms` (what was really heard)."""

    TYPE = "conversation.item.truncate"
    item_id: str
    content_index: int = 0
    audio_end_ms: int | float

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        content_index = data.get("content_index", 0)
        if (
            not isinstance(content_index, int)
            or isinstance(content_index, bool)
            or content_index < 0
        ):
            raise RealtimeProtocolError(
                "bad_event", "content_index must be an integer >= 0", param="content_index"
            )
        return cls(
            event_id=client_event_id(data),
            item_id=require_item_id(data),
            content_index=content_index,
            audio_end_ms=require_number(data, "audio_end_ms"),  # type: ignore[arg-type]
        )


# ---------------------------------------------------------------- Tier 2 bases


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferAppend(RealtimeCommand):
    """OpenAI's append: base64 `audio` on the wire, decoded bytes here."""

    TYPE = "input_audio_buffer.append"
    audio: bytes = b""

    def wire_body(self) -> JSON:
        return {"audio": b64encode_audio(self.audio)}

    @classmethod
    def read_audio(cls, data: Mapping[str, Any]) -> bytes:
        audio = data.get("audio", "")
        if audio is None:
            return b""
        if not isinstance(audio, str):
            raise RealtimeProtocolError("bad_audio", "audio must be a base64 string", param="audio")
        return b64decode_audio(audio)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT) -> Self:
        return cls(event_id=client_event_id(data), audio=cls.read_audio(data))


@dataclasses.dataclass(kw_only=True)
class InputAudioBufferCommit(RealtimeCommand):
    """Close the user turn (OpenAI shape)."""

    TYPE = "input_audio_buffer.commit"


TIER1_COMMAND_CLASSES: tuple[type[RealtimeCommand], ...] = (
    UpdateSession,
    ClearInput,
    ClearOutputAudio,
    CreateResponse,
    CancelResponse,
    CreateItem,
    DeleteItem,
    TruncateItem,
)
EXTENDED_COMMAND_CLASSES: tuple[type[RealtimeCommand], ...] = (
    InputAudioBufferAppend,
    InputAudioBufferCommit,
)

#: wire type -> class for OpenAI's 10 client commands.
REALTIME_CLIENT_COMMANDS: dict[str, type[RealtimeCommand]] = build_registry(
    *TIER1_COMMAND_CLASSES, *EXTENDED_COMMAND_CLASSES
)


def parse_realtime_command(
    data: Mapping[str, Any], ctx: CommandContext = DEFAULT_CONTEXT
) -> RealtimeCommand:
    """A decoded client event -> one of OpenAI's 10 commands (`unknown_event` otherwise)."""
    cls = REALTIME_CLIENT_COMMANDS.get(data.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise RealtimeProtocolError(
            "unknown_event", f"unknown client event type {data.get('type')!r}", param="type"
        ).with_event_id(client_event_id(data))
    try:
        return cls.from_wire(data, ctx)
    except RealtimeProtocolError as exc:
        raise exc.with_event_id(client_event_id(data)) from None
