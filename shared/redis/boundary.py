"""Every record that crosses the API-to-worker boundary, and the form it has in Redis.

API pods and workers meet only in Redis (docs/redis-keys.md); this module is where either side
turns what it means into what Redis holds, and back:

- `OpenRequest`, `CommandRecord`, `CloseRequest`, `TouchRequest`, `ChatRequest`: entries of
  `duplex:worker:{WID}:inbox`, written by API pods (closes also by the janitor and the admin
  CLI), read by the worker. One flat envelope, `InboxMessage` (fields `k s a q p b`), carries
  them all; `InboxRecord.from_fields` reads any of them back as its typed record.
- `ChatReply`: the one element of `duplex:reply:{ID}`, worker to API pod.
- `WorkerRegistration`: the hash `duplex:worker:{WID}`, written by its worker, read by
  placement and `duplex workers`.
- `ControlNotice`: `!`-prefixed messages on a session's live channel (takeover, moved).
- `RestoreRequest`: an inbox entry that hands a worker a session from its checkpoint.

Commands cross validated once. The API pod parses and validates a client frame with
`parse_client_event`; the entry carries the command as the codec renders it (its canonical wire
JSON, what `redis-cli` shows), except that an append's audio travels raw in its own field and is
never base64-encoded. The worker rebuilds the typed command from those fields with its class's
own constructor (`rebuild_command`): no parsing, no validation, no base64 a second time.

Only that rebuild needs the wire codec (and numpy with it): it imports the codec when a process
decodes its first command, so the Redis readers (`duplex sessions`, `duplex workers`) never load
it.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Self

import orjson

if TYPE_CHECKING:
    from shared.protocol.duplex import DuplexCommand

#: what an inbox entry costs the budget at least (a stream entry's own overhead, about):
#: with it the byte budget of inbox_append.lua also bounds the count of entries (64 MiB /
#: 640 B is about 100 000), so one counter does both and Redis runs no XLEN per append
MIN_ENTRY_BYTES = 640
OPEN, COMMAND, CLOSE, TOUCH, CHAT = "open", "command", "close", "touch", "chat"
RESTORE = "restore"
#: the inbox entries of a moved session that its new worker gets, as read, from the old
#: inbox (a drain forwarding, the dead-worker sweep replaying): an open is never moved, a
#: chat belongs to no session, a restore the old worker had not read is superseded
FORWARDED_KINDS = frozenset({COMMAND.encode(), TOUCH.encode(), CLOSE.encode()})
#: live-channel messages that start with this byte are control notices, not events
CONTROL_PREFIX = b"!"
TAKEOVER_KIND = "takeover"
TAKEOVER = CONTROL_PREFIX + TAKEOVER_KIND.encode() + b" "
MOVED_KIND = "moved"
#: the one command whose audio travels beside its payload
APPEND_TYPE = "input_audio_buffer.append"
#: fields a command class renders under another wire key (everything else: its own name)
_WIRE_KEYS: dict[str, dict[str, str]] = {
    "session.update": {"patch": "session"},
    "response.create": {"options": "response"},
}


# ---------------------------------------------------------------- worker inbox entries


@dataclasses.dataclass(frozen=True)
class InboxMessage:
    """The flat envelope of every inbox entry; the typed records below are written as one."""

    kind: str
    session_id: str
    attachment: int = 0  # the sender's attachment generation
    seq: int = 0  # per-attachment command seq: redelivered commands are recognised by it
    payload: dict[str, Any] = dataclasses.field(default_factory=dict)
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

    def record(self) -> InboxRecord:
        """The typed record this entry carries (a command is rebuilt, not re-validated)."""
        kind = _INBOX_KINDS.get(self.kind)
        if kind is None:
            raise ValueError(f"unknown inbox entry kind {self.kind!r}")
        return kind.from_message(self)


def entry_bytes(fields: Mapping[Any, Any]) -> int:
    """What an inbox entry costs the inbox's budget: its payload and its audio, and at least
    MIN_ENTRY_BYTES.

    The API counts it from the fields it writes (str keys), the worker from the fields it
    reads (bytes keys): both must agree, so only the two byte fields count."""
    payload = fields.get("p", fields.get(b"p", b""))
    audio = fields.get("b", fields.get(b"b", b""))
    return max(len(payload) + len(audio), MIN_ENTRY_BYTES)


class InboxRecord(abc.ABC):
    """Base of the typed inbox records: each is written as one `InboxMessage`."""

    KIND: ClassVar[str]

    @abc.abstractmethod
    def to_message(self) -> InboxMessage: ...

    @classmethod
    @abc.abstractmethod
    def from_message(cls, message: InboxMessage) -> Self: ...

    def to_fields(self) -> dict[str, bytes | str | int]:
        return self.to_message().to_fields()

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> Self:
        """The record an entry read from the inbox carries; on a subclass, of that kind only."""
        record = InboxMessage.from_fields(fields).record()
        if not isinstance(record, cls):
            raise ValueError(f"a {type(record).__name__} entry is not a {cls.__name__}")
        return record


@dataclasses.dataclass(frozen=True)
class OpenRequest(InboxRecord):
    KIND: ClassVar[str] = OPEN
    session_id: str
    session: dict[str, Any]  # the opening session object, with the model the API pod chose
    attachment: int = 1

    def to_message(self) -> InboxMessage:
        return InboxMessage(OPEN, self.session_id, self.attachment, 0, {"session": self.session})

    @classmethod
    def from_message(cls, message: InboxMessage) -> Self:
        session = message.payload.get("session") or {}
        return cls(message.session_id, session, message.attachment)


@dataclasses.dataclass(frozen=True)
class CommandRecord(InboxRecord):
    """A validated client command, with the (attachment, seq) the worker deduplicates on."""

    KIND: ClassVar[str] = COMMAND
    session_id: str
    attachment: int
    seq: int
    command: DuplexCommand

    @property
    def command_type(self) -> str:
        return self.command.TYPE

    def to_message(self) -> InboxMessage:
        command = self.command
        if command.TYPE != APPEND_TYPE:
            payload = command.to_dict()
            return InboxMessage(COMMAND, self.session_id, self.attachment, self.seq, payload)
        # the audio travels raw beside the payload: rendering it would base64-encode it only
        # for it to be dropped (17% of the API pod's time under 8 MiB appends, bench/exhaustion)
        payload = dataclasses.replace(command, audio=b"").to_dict()
        payload.pop("audio", None)
        audio: bytes = command.audio  # type: ignore[attr-defined]
        return InboxMessage(COMMAND, self.session_id, self.attachment, self.seq, payload, audio)

    @classmethod
    def from_message(cls, message: InboxMessage) -> Self:
        command = rebuild_command(message.payload, message.audio)
        return cls(message.session_id, message.attachment, message.seq, command)


@dataclasses.dataclass(frozen=True)
class CloseRequest(InboxRecord):
    KIND: ClassVar[str] = CLOSE
    session_id: str
    reason: str = "client_close"  # the session.closed reason
    attachment: int = 0  # 0: from the janitor or an operator, not from a connection

    def to_message(self) -> InboxMessage:
        return InboxMessage(CLOSE, self.session_id, self.attachment, 0, {"reason": self.reason})

    @classmethod
    def from_message(cls, message: InboxMessage) -> Self:
        reason = message.payload.get("reason", "client_close")
        return cls(message.session_id, reason, message.attachment)


@dataclasses.dataclass(frozen=True)
class TouchRequest(InboxRecord):
    """A resumed session's new attachment: the worker refreshes the session's lease."""

    KIND: ClassVar[str] = TOUCH
    session_id: str
    attachment: int

    def to_message(self) -> InboxMessage:
        return InboxMessage(TOUCH, self.session_id, self.attachment)

    @classmethod
    def from_message(cls, message: InboxMessage) -> Self:
        return cls(message.session_id, message.attachment)


@dataclasses.dataclass(frozen=True)
class ChatRequest(InboxRecord):
    """`POST /v1/chat/completions`; the worker answers on `duplex:reply:{request_id}`."""

    KIND: ClassVar[str] = CHAT
    request_id: str
    messages: list[Any]

    def to_message(self) -> InboxMessage:
        return InboxMessage(CHAT, self.request_id, payload={"messages": self.messages})

    @classmethod
    def from_message(cls, message: InboxMessage) -> Self:
        return cls(message.session_id, message.payload.get("messages") or [])


@dataclasses.dataclass(frozen=True)
class RestoreRequest(InboxRecord):
    """Take over a session from its checkpoint (`duplex:session:{SID}:checkpoint`): its old
    worker drained it (`drain`), or the dead-worker sweep re-placed it (`worker_lost`).
    `owner_generation` is the one owner_move.lua gave this worker: every write is fenced
    on it."""

    KIND: ClassVar[str] = RESTORE
    session_id: str
    owner_generation: int
    reason: str  # drain | worker_lost
    from_worker: str = ""

    def to_message(self) -> InboxMessage:
        payload = {"owner_generation": self.owner_generation, "reason": self.reason}
        if self.from_worker:
            payload["from_worker"] = self.from_worker
        return InboxMessage(RESTORE, self.session_id, payload=payload)

    @classmethod
    def from_message(cls, message: InboxMessage) -> Self:
        payload = message.payload
        return cls(
            message.session_id,
            int(payload.get("owner_generation", 0)),
            str(payload.get("reason", "")),
            str(payload.get("from_worker", "")),
        )


_INBOX_KINDS: dict[str, type[InboxRecord]] = {
    record.KIND: record
    for record in (
        OpenRequest,
        CommandRecord,
        CloseRequest,
        TouchRequest,
        ChatRequest,
        RestoreRequest,
    )
}


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


def rebuild_command(payload: Mapping[str, Any], audio: bytes = b"") -> DuplexCommand:
    """The command `CommandRecord.to_message` wrote, rebuilt with its class's constructor.

    Trusted: the API pod validated it, so nothing is checked again; a field the payload does
    not carry (the codec leaves out None and empty extras) takes the class's default."""
    wire_type = payload.get("type")
    cls = _command_classes().get(wire_type) if isinstance(wire_type, str) else None
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


# ---------------------------------------------------------------- chat replies


@dataclasses.dataclass(frozen=True)
class ChatReply:
    """The worker's answer to a ChatRequest: the text, or an error code and message."""

    ok: bool
    text: str = ""
    code: str = ""
    message: str = ""

    @classmethod
    def answer(cls, text: str) -> ChatReply:
        return cls(True, text=text)

    @classmethod
    def failure(cls, code: str, message: str) -> ChatReply:
        return cls(False, code=code, message=message)

    def to_bytes(self) -> bytes:
        if self.ok:
            return orjson.dumps({"ok": True, "text": self.text})
        return orjson.dumps({"ok": False, "code": self.code, "message": self.message})

    @classmethod
    def parse(cls, data: bytes) -> ChatReply:
        reply = orjson.loads(data)
        if reply["ok"]:
            return cls.answer(reply["text"])
        return cls.failure(reply["code"], reply["message"])


# ---------------------------------------------------------------- worker registration


@dataclasses.dataclass(frozen=True)
class WorkerRegistration:
    """A worker's hash `duplex:worker:{WID}` (its id is in the key, not in the hash)."""

    worker_id: str
    model: str
    max_sessions: int
    active: int = 0
    capabilities: dict[str, Any] = dataclasses.field(default_factory=dict)  # realtime JSON
    version: str = ""
    started_at: int = 0  # ms since the epoch
    #: the worker is draining (SIGTERM): placement sends it no new session, and its
    #: sessions are moving to other workers; it still beats until the last one has moved
    draining: bool = False

    def to_hash(self) -> dict[str, str | int | bytes]:
        return {
            "model": self.model,
            "max_sessions": self.max_sessions,
            **self.load_fields(self.active),
            "capabilities": orjson.dumps(self.capabilities),
            "version": self.version,
            "started_at": self.started_at,
            "draining": int(self.draining),
        }

    @staticmethod
    def load_fields(active: int) -> dict[str, str | int | bytes]:
        """The one field a worker rewrites between heartbeats (placement reads it)."""
        return {"active": active}

    @classmethod
    def from_hash(cls, worker_id: str, fields: Mapping[bytes, bytes]) -> WorkerRegistration | None:
        """None when the hash holds no registration (gone, or only a load update)."""
        if b"model" not in fields:
            return None
        return cls(
            worker_id=worker_id,
            model=fields[b"model"].decode(),
            max_sessions=int(fields.get(b"max_sessions", b"0")),
            active=int(fields.get(b"active", b"0")),
            capabilities=orjson.loads(fields.get(b"capabilities", b"{}")),
            version=fields.get(b"version", b"").decode(),
            started_at=int(fields.get(b"started_at", b"0")),
            draining=fields.get(b"draining", b"0") == b"1",
        )


# ---------------------------------------------------------------- live-channel control notices


@dataclasses.dataclass(frozen=True)
class ControlNotice:
    """A control message on a session's live channel, beside its events:

    - `!takeover <attachment generation>`: a newer attachment took the session;
    - `!moved <owner generation> <worker id>`: the session now lives on that worker (a
      drain or a failover moved it); API pods send its commands there from now on.
    """

    kind: str
    attachment_generation: int = 0  # for `moved`: the owner generation
    worker_id: str = ""

    @classmethod
    def takeover(cls, attachment_generation: int) -> ControlNotice:
        """A newer attachment took the session: older sockets are replaced."""
        return cls(TAKEOVER_KIND, attachment_generation)

    @classmethod
    def moved(cls, owner_generation: int, worker_id: str) -> ControlNotice:
        """The session's new owner: route its commands to `worker_id`."""
        return cls(MOVED_KIND, owner_generation, worker_id)

    @property
    def owner_generation(self) -> int:
        return self.attachment_generation if self.kind == MOVED_KIND else 0

    def replaces(self, attachment_generation: int) -> bool:
        """Whether a socket holding `attachment_generation` must give the session up."""
        return self.kind == TAKEOVER_KIND and self.attachment_generation > attachment_generation

    def to_bytes(self) -> bytes:
        text = f"{self.kind} {self.attachment_generation}"
        if self.worker_id:
            text += f" {self.worker_id}"
        return CONTROL_PREFIX + text.encode()

    @classmethod
    def parse(cls, data: bytes) -> ControlNotice | None:
        """The notice, or None for a live message that is an event."""
        if not data.startswith(CONTROL_PREFIX):
            return None
        kind, _, rest = data[len(CONTROL_PREFIX) :].partition(b" ")
        generation, _, worker = rest.partition(b" ")
        return cls(kind.decode(), int(generation) if generation.isdigit() else 0, worker.decode())
