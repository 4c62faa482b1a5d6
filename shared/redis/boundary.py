"""Every record that crosses the API-to-worker boundary, and the form it has in Redis.

API pods and workers meet only in Redis (docs/redis-keys.md); this module is where either side
turns what it means into what Redis holds, and back:

- `OpenRequest`, `CommandRecord`, `CloseRequest`, `TouchRequest`, `ChatRequest`,
  `RestoreRequest` (and `UnknownCommand`, a newer API pod's command): the messages of
  `duplex:worker:{WID}:inbox`, written by API pods (closes also by the janitor and the admin
  CLI, restores by a drain or the dead-worker sweep), read by the worker. They are msgspec
  Structs tagged by their kind, `InboxMessage` is their union, and an entry holds one or
  more of them: `encode_entry` writes one, `decode_entry` reads one back with one decoder
  call. Defined in `shared.redis.inbox_codec` (re-exported here).
- `ChatReply`: the one element of `duplex:reply:{ID}`, worker to API pod.
- `WorkerRegistration`: the hash `duplex:worker:{WID}`, written by its worker, read by
  placement and `duplex workers`.
- `ControlNotice`: `!`-prefixed messages on a session's live channel (takeover, moved);
  defined with the rest of the live channel's format in `shared.redis.live_message`
  (re-exported here).

Commands cross validated once: the API pod parses and validates a client frame with
`parse_client_event`, and the worker gets the typed command msgspec built from the entry's
JSON and raw audio: no parsing, no validation, no base64 a second time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import orjson

from shared.redis.inbox_codec import (
    APPEND_TYPE,
    CHAT,
    CLOSE,
    COMMAND,
    FORWARDED_KINDS,
    MIN_ENTRY_BYTES,
    OPEN,
    RESTORE,
    TOUCH,
    ChatRequest,
    CloseRequest,
    CommandRecord,
    InboxMessage,
    InboxRecord,
    MalformedEntry,
    OpenRequest,
    RestoreRequest,
    TouchRequest,
    UnknownCommand,
    decode_entry,
    encode_entry,
    entry_bytes,
)
from shared.redis.live_message import (
    CONTROL_PREFIX,
    MOVED_KIND,
    TAKEOVER,
    TAKEOVER_KIND,
    ControlNotice,
)

__all__ = [
    "APPEND_TYPE",
    "CHAT",
    "CLOSE",
    "COMMAND",
    "CONTROL_PREFIX",
    "FORWARDED_KINDS",
    "MIN_ENTRY_BYTES",
    "MOVED_KIND",
    "OPEN",
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
    "MalformedEntry",
    "OpenRequest",
    "RestoreRequest",
    "TouchRequest",
    "UnknownCommand",
    "WorkerRegistration",
    "decode_entry",
    "encode_entry",
    "entry_bytes",
]


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
