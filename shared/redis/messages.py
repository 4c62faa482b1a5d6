"""Messages between API pods and workers: worker inbox entries and live-channel control notices.

Inbox entries are flat stream fields. A command travels as its wire JSON,
except that an append's audio travels raw in its own field (not base64).
This module needs no wire codec, so the admin CLI can write a close without loading it;
client commands become entries in `shared.redis.command_messages`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import orjson

#: what an inbox entry costs the budget at least (a stream entry's own overhead, about):
#: with it the byte budget of inbox_append.lua also bounds the count of entries (64 MiB /
#: 640 B is about 100 000), so one counter does both and Redis runs no XLEN per append
MIN_ENTRY_BYTES = 640
OPEN, COMMAND, CLOSE, TOUCH, CHAT = "open", "command", "close", "touch", "chat"
#: live-channel messages that start with this byte are control notices, not events
CONTROL_PREFIX = b"!"
TAKEOVER = b"!takeover "


@dataclasses.dataclass
class InboxMessage:
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
    def from_fields(cls, fields: dict[bytes, bytes]) -> InboxMessage:
        return cls(
            kind=fields[b"k"].decode(),
            session_id=fields[b"s"].decode(),
            attachment=int(fields.get(b"a", b"0")),
            seq=int(fields.get(b"q", b"0")),
            payload=orjson.loads(fields.get(b"p", b"{}")),
            audio=fields.get(b"b", b""),
        )


def entry_bytes(fields: Mapping[Any, Any]) -> int:
    """What an inbox entry costs the inbox's budget: its payload and its audio, and at least
    MIN_ENTRY_BYTES.

    The API counts it from the fields it writes (str keys), the worker from the fields it
    reads (bytes keys): both must agree, so only the two byte fields count."""
    payload = fields.get("p", fields.get(b"p", b""))
    audio = fields.get("b", fields.get(b"b", b""))
    return max(len(payload) + len(audio), MIN_ENTRY_BYTES)


def takeover_notice(attachment_generation: int) -> bytes:
    return TAKEOVER + str(attachment_generation).encode()
