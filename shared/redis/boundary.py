"""Every record that crosses the API-to-worker boundary, and the form it has in Redis.

API pods and workers meet only in Redis (docs/redis-keys.md); this module is where either side
turns what it means into what Redis holds, and back:

- `OpenRequest`, `CommandRecord`, `CloseRequest`, `TouchRequest`, `ChatRequest`: entries of
  `duplex:worker:{WID}:inbox`, written by API pods (closes also by the janitor and the admin
  CLI), read by the worker. One flat envelope, `InboxMessage` (fields `k s a q p b`), carries
  them all; `InboxRecord.from_fields` reads any of them back as its typed record. The
  envelope, packs of several messages in one entry and the command codec are in
  `shared.redis.inbox_codec` (re-exported here).
- `ChatReply`: the one element of `duplex:reply:{ID}`, worker to API pod.
- `WorkerRegistration`: the hash `duplex:worker:{WID}`, written by its worker, read by
  placement and `duplex workers`.
- `ControlNotice`: `!`-prefixed messages on a session's live channel (takeover, moved).
- `RestoreRequest`: an inbox entry that hands a worker a session from its checkpoint.

Commands cross validated once: the API pod parses and validates a client frame with
`parse_client_event`, and the worker rebuilds the typed command from the entry's fields with
its class's own constructor (`rebuild_command`): no parsing, no validation, no base64 a second
time.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Self

import orjson

from shared.redis.inbox_codec import (
    APPEND_TYPE,
    CHAT,
    CLOSE,
    COMMAND,
    INBOX_KINDS,
    MIN_ENTRY_BYTES,
    OPEN,
    PACK,
    PACK_KIND,
    RESTORE,
    TOUCH,
    InboxMessage,
    command_payload,
    entry_bytes,
    message_fields,
    pack_entry,
    rebuild_command,
    unpack_entry,
)

if TYPE_CHECKING:
    from shared.protocol.duplex import DuplexCommand

__all__ = [
    "APPEND_TYPE",
    "CHAT",
    "CLOSE",
    "COMMAND",
    "CONTROL_PREFIX",
    "FORWARDED_KINDS",
    "INBOX_KINDS",
    "MIN_ENTRY_BYTES",
    "MOVED_KIND",
    "OPEN",
    "PACK",
    "PACK_KIND",
    "RESTORE",
    "TAKEOVER",
    "TAKEOVER_KIND",
    "TOUCH",
    "ChatReply",
    "ChatRequest",
    "CloseRequest",
    "CommandRecord",
    "ControlNotice",
    "InboxMessage",
    "InboxRecord",
    "OpenRequest",
    "RestoreRequest",
    "TouchRequest",
    "WorkerRegistration",
    "command_payload",
    "entry_bytes",
    "message_fields",
    "pack_entry",
    "rebuild_command",
    "unpack_entry",
]

#: the inbox entries of a moved session that its new worker gets, as read, from the old
#: inbox (a drain forwarding, the dead-worker sweep replaying): an open is never moved, a
#: chat belongs to no session, a restore the old worker had not read is superseded
FORWARDED_KINDS = frozenset({COMMAND.encode(), TOUCH.encode(), CLOSE.encode()})
#: live-channel messages that start with this byte are control notices, not events
CONTROL_PREFIX = b"!"
TAKEOVER_KIND = "takeover"
TAKEOVER = CONTROL_PREFIX + TAKEOVER_KIND.encode() + b" "
MOVED_KIND = "moved"


# ---------------------------------------------------------------- worker inbox entries


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
        payload, audio = command_payload(self.command)
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


INBOX_KINDS.update(
    (record.KIND, record)
    for record in (
        OpenRequest,
        CommandRecord,
        CloseRequest,
        TouchRequest,
        ChatRequest,
        RestoreRequest,
    )
)


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
