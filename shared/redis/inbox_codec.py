"""The inbox messages and the form an inbox entry has in Redis: one module, one codec.

Every message of `duplex:worker:{WID}:inbox` is a typed record, a frozen msgspec `Struct`
tagged by its kind (field `k`): `OpenRequest`, `CommandRecord`, `CloseRequest`,
`TouchRequest`, `ChatRequest`, `RestoreRequest`; `InboxMessage` is their union. Each has a
`session_id` (a chat: its request id).

An entry, whoever wrote it (an API pod's writer round, a drain or the dead-worker sweep
forwarding, a handover's restore, `duplex sessions close`), has one shape:

- `m`: the JSON array of its messages, in order, e.g.
  `[{"k":"command","s":"duplex-…","a":1,"q":7,"c":["input_audio_buffer.append",
  {"event_id":"e1","format":"pcm16","sample_rate_hz":16000}]},{"k":"close","s":…}]`;
- `b<i>`: the raw audio of message `i` when it is an append (present even when empty;
  never base64).

`decode_entry` reads an entry with **one** msgspec decoder call (`m` as
`list[<the tagged union>]`): msgspec checks every tag and every field's type, the command
bodies included, and builds the typed commands. Nothing is checked by hand; an entry that
does not decode, or an append whose audio field is missing, is refused whole
(`MalformedEntry`).

A command crosses as `c` = `[wire type, body]`: the body is the command dataclass itself
(`shared.protocol.duplex`), encoded and decoded by msgspec by its attribute names (no wire
keys, no reflection of ours, no validation of the client's frame again: the API pod did
that). An append's body is its validated fields but the audio (`AppendAudio.inbox_fields`,
named by `INBOX_FIELDS`, trailing defaults left out), its audio is `b<i>`. msgspec cannot
decode a union of dataclasses, so each command class gets a small tagged wrapper (`c`'s
array form: the tag first) built from `DUPLEX_COMMANDS`; `CommandRecord` is what callers
see, its wire form `_CommandWire` is private.

A command of a type this worker does not know (a newer API pod's) does not fail the entry:
it is read as an `UnknownCommand` (the worker answers `unknown_event`, and forwards it as
read when its session moved); the rest of the entry is dispatched as usual.

The command classes (the wire codec, and numpy with it) are imported when a process first
encodes a command or decodes an entry: `duplex sessions close` writes a close without them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar, Union, cast

import msgspec
from msgspec import field

if TYPE_CHECKING:
    from shared.protocol.duplex import AppendAudio, DuplexCommand

__all__ = [
    "APPEND_TYPE",
    "CHAT",
    "CLOSE",
    "COMMAND",
    "FORWARDED_KINDS",
    "MIN_ENTRY_BYTES",
    "OPEN",
    "RESTORE",
    "TOUCH",
    "ChatRequest",
    "CloseRequest",
    "CommandRecord",
    "InboxMessage",
    "InboxRecord",
    "MalformedEntry",
    "OpenRequest",
    "RestoreRequest",
    "TouchRequest",
    "UnknownCommand",
    "decode_entry",
    "encode_entry",
    "entry_bytes",
]

#: what an inbox entry costs the budget at least (a stream entry's own overhead, about):
#: with it the byte budget of inbox_append.lua also bounds the count of entries (64 MiB /
#: 640 B is about 100 000), so one counter does both and Redis runs no XLEN per append
MIN_ENTRY_BYTES = 640
#: the tags (`k`) of the inbox messages
OPEN, COMMAND, CLOSE, TOUCH, CHAT = "open", "command", "close", "touch", "chat"
RESTORE = "restore"
#: the one command whose audio travels beside the JSON
APPEND_TYPE = "input_audio_buffer.append"


class MalformedEntry(ValueError):
    """An entry no API pod wrote: it is refused whole."""


class _Tagged(msgspec.Struct, frozen=True, tag_field="k"):
    """The msgspec configuration every inbox message shares: frozen, tagged by `k`."""


class InboxRecord(_Tagged, frozen=True):
    """Base of the typed inbox messages."""

    def to_fields(self) -> dict[str, bytes]:
        """An entry holding this message alone (`encode_entry`)."""
        return encode_entry([self])  # type: ignore[list-item]

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> Self:
        """The one message of an entry, which must be of this class (tests, tools)."""
        messages = decode_entry(fields)
        if len(messages) != 1 or not isinstance(messages[0], cls):
            kinds = ", ".join(type(message).__name__ for message in messages)
            raise ValueError(f"an entry of {kinds} is not a {cls.__name__}")
        return messages[0]

    @property
    def audio(self) -> bytes:
        """The raw audio the message carries beside its JSON (an append's)."""
        return b""


class OpenRequest(InboxRecord, frozen=True, tag=OPEN):
    session_id: str = field(name="s")
    session: dict[str, Any]  # the opening session object, with the model the API pod chose
    attachment: int = field(default=1, name="a")


class CommandRecord(InboxRecord, frozen=True, tag=COMMAND):
    """A validated client command, with the (attachment, seq) the worker deduplicates on.
    In an entry it is a `_CommandWire` (`c` = `[wire type, body]`)."""

    session_id: str
    attachment: int
    seq: int
    command: DuplexCommand

    @property
    def command_type(self) -> str:
        return self.command.TYPE

    @property
    def audio(self) -> bytes:
        if self.command.TYPE == APPEND_TYPE:
            return cast("AppendAudio", self.command).audio
        return b""

    def with_seq(self, seq: int) -> CommandRecord:
        """The same command under another seq (the writer hands seqs out late)."""
        return CommandRecord(self.session_id, self.attachment, seq, self.command)


class CloseRequest(InboxRecord, frozen=True, tag=CLOSE):
    session_id: str = field(name="s")
    reason: str = "client_close"  # the session.closed reason
    attachment: int = field(default=0, name="a")  # 0: from the janitor or an operator


class TouchRequest(InboxRecord, frozen=True, tag=TOUCH):
    """A resumed session's new attachment: the worker refreshes the session's lease."""

    session_id: str = field(name="s")
    attachment: int = field(name="a")


class ChatRequest(InboxRecord, frozen=True, tag=CHAT):
    """`POST /v1/chat/completions`; the worker answers on `duplex:reply:{request_id}`."""

    request_id: str = field(name="s")
    messages: list[Any]

    @property
    def session_id(self) -> str:
        """A chat belongs to no session: its request id stands in (a drain passes it by)."""
        return self.request_id


class RestoreRequest(InboxRecord, frozen=True, tag=RESTORE):
    """Take over a session from its checkpoint (`duplex:session:{SID}:checkpoint`): its old
    worker drained it (`drain`), or the dead-worker sweep re-placed it (`worker_lost`).
    `owner_generation` is the one owner_move.lua gave this worker: every write is fenced
    on it."""

    session_id: str = field(name="s")
    owner_generation: int
    reason: str  # drain | worker_lost
    from_worker: str = ""


class UnknownCommand(InboxRecord, frozen=True, tag=COMMAND):
    """A command whose wire type this worker does not know (a newer API pod wrote it): it is
    refused with `unknown_event`, and forwarded as read when its session moved."""

    session_id: str = field(name="s")
    attachment: int = field(name="a")
    seq: int = field(name="q")
    body: tuple[str, dict[str, Any]] = field(name="c")

    @property
    def command_type(self) -> str:
        return self.body[0]

    @property
    def event_id(self) -> str | None:
        event_id = self.body[1].get("event_id")
        return event_id if isinstance(event_id, str) else None


InboxMessage = (
    OpenRequest
    | CommandRecord
    | CloseRequest
    | TouchRequest
    | ChatRequest
    | RestoreRequest
    | UnknownCommand
)
#: the messages of a moved session that its new worker gets, as read, from the old inbox
#: (a drain forwarding, the dead-worker sweep replaying): an open is never moved, a chat
#: belongs to no session, a restore the old worker had not read is superseded
FORWARDED_KINDS: tuple[type[InboxRecord], ...] = (
    CommandRecord,
    UnknownCommand,
    TouchRequest,
    CloseRequest,
)


# ---------------------------------------------------------------- the wire form of commands

_Body = TypeVar("_Body")


class _CommandWire(_Tagged, Generic[_Body], frozen=True, tag=COMMAND):
    """A `CommandRecord` in an entry: `c` is `[wire type, body]`. Decoded with `_Body` the
    union of the command classes' wrappers, so msgspec builds the typed command itself."""

    session_id: str = field(name="s")
    attachment: int = field(name="a")
    seq: int = field(name="q")
    body: _Body = field(name="c")


class _CommandBody(msgspec.Struct, frozen=True, array_like=True):
    """`[wire type, command]`: one subclass per command class, tagged by its wire type,
    whose one field `command` is of that class (`_Codec`)."""


class _Codec:
    """The decoders, and each command class's wrapper; built once (`_codec`)."""

    def __init__(self) -> None:
        from shared.protocol.duplex import DUPLEX_COMMANDS, SURFACE_COMMANDS
        from shared.protocol.duplex.commands import INBOX_FIELDS

        self.append_fields = INBOX_FIELDS
        self.bodies = {
            wire_type: msgspec.defstruct(
                f"{cls.__name__}Body",
                [("command", cls)],
                bases=(_CommandBody,),
                tag=wire_type,
                frozen=True,
                module=__name__,
            )
            for wire_type, cls in {**DUPLEX_COMMANDS, **SURFACE_COMMANDS}.items()
        }
        self.append_body = self.bodies[APPEND_TYPE]
        bodies = Union[tuple(self.bodies.values())]  # noqa: UP007 (a union built at run time)
        others = (OpenRequest, CloseRequest, TouchRequest, ChatRequest, RestoreRequest)
        wire = Union[(_CommandWire[bodies], *others)]
        #: the one call per entry
        self.entry = msgspec.json.Decoder(list[wire])
        # only for an entry `entry` refused: which of its messages failed, and whether that
        # is a command of a type unknown here (read as an UnknownCommand) or a bad entry
        self.raw_list = msgspec.json.Decoder(list[msgspec.Raw])
        self.one = msgspec.json.Decoder(wire)
        self.unknown = msgspec.json.Decoder(Union[(UnknownCommand, *others)])


@functools.cache
def _codec() -> _Codec:
    return _Codec()


_ENCODER = msgspec.json.Encoder()


# ---------------------------------------------------------------- entries


def encode_entry(messages: Sequence[InboxMessage]) -> dict[str, bytes]:
    """One entry holding `messages`, in their order: `m` and the appends' `b<i>`."""
    fields: dict[str, bytes] = {"m": b""}
    wire: list[Any] = []
    for index, message in enumerate(messages):
        if type(message) is CommandRecord:
            command = message.command
            body: Any = command
            if command.TYPE == APPEND_TYPE:
                # the audio travels raw beside the JSON: its validated fields are the body
                append = cast("AppendAudio", command)
                body = dict(zip(_codec().append_fields, append.inbox_fields(), strict=False))
                fields[f"b{index}"] = append.audio
            wire.append(
                _CommandWire(
                    message.session_id, message.attachment, message.seq, (command.TYPE, body)
                )
            )
        else:
            wire.append(message)
    fields["m"] = _ENCODER.encode(wire)
    return fields


def decode_entry(fields: Mapping[bytes, bytes]) -> list[InboxMessage]:
    """The messages of an entry read from an inbox (bytes keys, as XREADGROUP returns
    them), in order. Raises `MalformedEntry` for an entry no API pod wrote."""
    codec = _codec()
    try:
        data = fields[b"m"]
    except KeyError:
        raise MalformedEntry("the entry has no messages (`m`)") from None
    try:
        wire = codec.entry.decode(data)
    except msgspec.ValidationError as exc:
        wire = _decode_each(codec, data, exc)
    except msgspec.DecodeError as exc:
        raise MalformedEntry(f"the entry's messages are not JSON: {exc}") from None
    messages: list[InboxMessage] = []
    for index, message in enumerate(wire):
        if type(message) is _CommandWire:
            body = message.body
            command = body.command
            if type(body) is codec.append_body:
                audio = fields.get(b"b%d" % index)
                if audio is None:
                    raise MalformedEntry(f"message {index} is an append without its audio")
                command.audio = audio  # decoded just now: nobody else holds it yet
            message = CommandRecord(message.session_id, message.attachment, message.seq, command)
        messages.append(message)
    return messages


def _decode_each(codec: _Codec, data: bytes, refused: msgspec.ValidationError) -> list[Any]:
    """The entry's messages one by one, after the entry as a whole did not decode: a command
    of a type unknown here is read as an `UnknownCommand`; anything else refuses the entry."""
    try:
        raws = codec.raw_list.decode(data)
    except msgspec.DecodeError:
        raise MalformedEntry(f"the entry does not decode: {refused}") from None
    wire: list[Any] = []
    for raw in raws:
        try:
            wire.append(codec.one.decode(raw))
            continue
        except msgspec.ValidationError:
            pass
        try:
            unknown = codec.unknown.decode(raw)
        except msgspec.ValidationError:
            unknown = None
        if not isinstance(unknown, UnknownCommand) or unknown.command_type in codec.bodies:
            raise MalformedEntry(f"the entry does not decode: {refused}") from None
        wire.append(unknown)
    return wire


def entry_bytes(fields: Mapping[Any, Any]) -> int:
    """What an inbox entry costs the inbox's budget: its messages (`m`) and its audio
    (`b<i>`), and at least MIN_ENTRY_BYTES.

    The API counts it from the fields it writes (str keys), the worker from the fields it
    reads (bytes keys): both must agree, so only those byte fields count."""
    size = 0
    for key, value in fields.items():
        name = key.decode() if isinstance(key, bytes) else key
        if name == "m" or name.startswith("b"):
            size += len(value)
    return max(size, MIN_ENTRY_BYTES)
