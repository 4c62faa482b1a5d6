"""The form a worker's inbox entries have in Redis: one message each, or a pack of them.

`InboxMessage` is the flat envelope of every inbox message (fields `k s a q p b`); the typed
records of `shared.redis.boundary` are written as one. An entry holds one message in those
fields, or, written by an API pod's round (`services/api/inbox_writer.py`), a **pack**:
several messages of many sessions bound for the same worker, in the order they were queued.

A pack's fields: `k` = `pack`, `m` = the JSON array of its messages' headers, each
`[kind, session, attachment, seq, payload]`, and `b<i>` = the raw audio of message `i` (only
those that have audio). One JSON decode per entry reads every header of it.

An append's payload is its field form (`AppendAudio.inbox_fields`: a short JSON array, the
audio beside it, never base64), in a pack and alone: the worker builds the command with
its class's constructor, with no JSON re-parse or validation of the client's frame. Every
other command's payload is its canonical wire JSON (what `redis-cli` shows), rebuilt the
same way (`rebuild_command`).

Only that rebuild needs the wire codec (and numpy with it): it is imported when a process
decodes its first command, so the Redis readers (`duplex sessions`, `duplex workers`) never
load it.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from shared.protocol.duplex import DuplexCommand

#: what an inbox entry costs the budget at least (a stream entry's own overhead, about):
#: with it the byte budget of inbox_append.lua also bounds the count of entries (64 MiB /
#: 640 B is about 100 000), so one counter does both and Redis runs no XLEN per append
MIN_ENTRY_BYTES = 640
OPEN, COMMAND, CLOSE, TOUCH, CHAT = "open", "command", "close", "touch", "chat"
RESTORE = "restore"
#: an entry that carries several messages (`pack_entry`)
PACK = "pack"
PACK_KIND = PACK.encode()
#: the one command whose audio travels beside its payload
APPEND_TYPE = "input_audio_buffer.append"
#: fields a command class renders under another wire key (everything else: its own name)
_WIRE_KEYS: dict[str, dict[str, str]] = {
    "session.update": {"patch": "session"},
    "response.create": {"options": "response"},
}
Payload = dict[str, Any] | list[Any]  # a list: an append's field form
#: kind -> the typed record class (`InboxRecord`) it carries; filled by shared.redis.boundary,
#: which defines them (and is what every reader of the inbox imports)
INBOX_KINDS: dict[str, Any] = {}


@dataclasses.dataclass(frozen=True)
class InboxMessage:
    """The flat envelope of every inbox message; the typed records are written as one."""

    kind: str
    session_id: str
    attachment: int = 0  # the sender's attachment generation
    seq: int = 0  # per-attachment command seq: redelivered commands are recognised by it
    payload: Payload = dataclasses.field(default_factory=dict)
    audio: bytes = b""

    def to_fields(self) -> dict[str, bytes | str | int]:
        fields: dict[str, bytes | str | int] = {
            "k": self.kind,
            "s": self.session_id,
            "a": self.attachment,
            "q": self.seq,
            "p": orjson.dumps(self.payload),
        }
        if self.audio:
            fields["b"] = self.audio
        return fields

    def header(self) -> list[Any]:
        """Its header in a pack (`pack_entry`)."""
        return [self.kind, self.session_id, self.attachment, self.seq, self.payload]

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> InboxMessage:
        return cls(
            kind=fields[b"k"].decode(),
            session_id=fields[b"s"].decode(),
            attachment=int(fields.get(b"a", b"0")),
            seq=int(fields.get(b"q", b"0")),
            payload=orjson.loads(fields.get(b"p", b"{}")),
            audio=fields.get(b"b", b""),
        )

    def record(self) -> Any:
        """The typed record this message carries (a command is rebuilt, not re-validated)."""
        kind = INBOX_KINDS.get(self.kind)
        if kind is None:
            raise ValueError(f"unknown inbox entry kind {self.kind!r}")
        return kind.from_message(self)


def entry_bytes(fields: Mapping[Any, Any]) -> int:
    """What an inbox entry costs the inbox's budget: its payload (`p`, or a pack's headers
    `m`) and its audio (`b`, `b<i>`), and at least MIN_ENTRY_BYTES.

    The API counts it from the fields it writes (str keys), the worker from the fields it
    reads (bytes keys): both must agree, so only those byte fields count."""
    size = 0
    for key, value in fields.items():
        name = key.decode() if isinstance(key, bytes) else key
        if name in ("p", "m") or name.startswith("b"):
            size += len(value)
    return max(size, MIN_ENTRY_BYTES)


def pack_entry(messages: Sequence[InboxMessage]) -> dict[str, bytes | str | int]:
    """One entry for `messages`, in their order: a lone message is written as itself."""
    if len(messages) == 1:
        return messages[0].to_fields()
    fields: dict[str, bytes | str | int] = {
        "k": PACK,
        "m": orjson.dumps([message.header() for message in messages]),
    }
    for index, message in enumerate(messages):
        if message.audio:
            fields[f"b{index}"] = message.audio
    return fields


def unpack_entry(fields: Mapping[bytes, bytes]) -> list[InboxMessage]:
    """The messages of an entry read from an inbox, in order. Raises ValueError (or
    KeyError, TypeError) for an entry no API pod wrote: the whole entry is refused."""
    if fields.get(b"k") != PACK_KIND:
        return [InboxMessage.from_fields(fields)]
    headers = orjson.loads(fields[b"m"])
    if not isinstance(headers, list):
        raise ValueError("a pack's headers are not a list")
    messages = []
    for index, header in enumerate(headers):
        if not isinstance(header, list) or len(header) != 5:
            raise ValueError(f"header {index} of a pack is not [k, s, a, q, p]")
        kind, session_id, attachment, seq, payload = header
        if not (
            isinstance(kind, str)
            and isinstance(session_id, str)
            and type(attachment) is int
            and type(seq) is int
            and isinstance(payload, dict | list)
        ):
            raise ValueError(f"header {index} of a pack has fields of the wrong types")
        audio = fields.get(b"b%d" % index, b"")
        messages.append(InboxMessage(kind, session_id, attachment, seq, payload, audio))
    return messages


def message_fields(message: InboxMessage) -> dict[bytes, bytes]:
    """A message as the fields of an entry of its own, as XREADGROUP returns them (bytes
    keys and values): what a drain forwards to the session's new worker."""
    return {
        key.encode(): value if isinstance(value, bytes) else str(value).encode()
        for key, value in message.to_fields().items()
    }


# ---------------------------------------------------------------- commands


def command_payload(command: DuplexCommand) -> tuple[Payload, bytes]:
    """A validated command's payload and its raw audio (the API pod's side)."""
    if command.TYPE == APPEND_TYPE:
        # the audio travels raw beside the field form: rendering it would base64-encode
        # it only for it to be dropped
        return command.inbox_fields(), command.audio  # type: ignore[attr-defined]
    return command.to_dict(), b""


def _command_classes() -> dict[str, type[DuplexCommand]]:
    from shared.protocol.duplex import DUPLEX_COMMANDS  # the codec: only where commands decode

    return DUPLEX_COMMANDS


@functools.cache
def _constructor_fields(cls: type[DuplexCommand]) -> tuple[tuple[str, str, bool], ...]:
    """For each field of a command class but its audio: (name, wire key, is a tuple)."""
    hints = typing.get_type_hints(cls)
    keys = _WIRE_KEYS.get(cls.TYPE, {})
    return tuple(
        (f.name, keys.get(f.name, f.name), typing.get_origin(hints[f.name]) is tuple)
        for f in dataclasses.fields(cls)
        if f.name != "audio"
    )


def rebuild_command(payload: Payload, audio: bytes = b"") -> DuplexCommand:
    """The command `command_payload` wrote, rebuilt with its class's constructor.

    Trusted: the API pod validated it, so nothing is checked again; a field the payload does
    not carry (the codec leaves out None and empty extras) takes the class's default."""
    classes = _command_classes()
    if isinstance(payload, list):  # an append's field form
        return classes[APPEND_TYPE].from_inbox_fields(payload, audio)  # type: ignore[attr-defined]
    wire_type = payload.get("type")
    cls = classes.get(wire_type) if isinstance(wire_type, str) else None
    if cls is None:  # a newer API pod's command, say: refused as the client's would be
        from shared.protocol.duplex import RealtimeProtocolError

        event_id = payload.get("event_id")
        raise RealtimeProtocolError(
            "unknown_event",
            f"unknown client event type {wire_type!r}",
            param="type",
            related_event_id=event_id if isinstance(event_id, str) else None,
        )
    kwargs = {
        name: tuple(payload[key]) if as_tuple else payload[key]
        for name, key, as_tuple in _constructor_fields(cls)
        if key in payload
    }
    if audio:
        kwargs["audio"] = audio
    return cls(**kwargs)
