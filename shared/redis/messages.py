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

#: unhandled entries a worker inbox takes before client commands are refused: a bound on
#: count, beside the byte budget (inbox_append.lua; never trimmed, which would drop them)
INBOX_MAX_ENTRIES = 100_000
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
    """What an inbox entry costs the inbox's byte budget: its payload and its audio.

    The API counts it from the fields it writes (str keys), the worker from the fields it
    reads (bytes keys): both must agree, so only the two byte fields count."""
    payload = fields.get("p", fields.get(b"p", b""))
    audio = fields.get("b", fields.get(b"b", b""))
    return len(payload) + len(audio)


def takeover_notice(attachment_generation: int) -> bytes:
    return TAKEOVER + str(attachment_generation).encode()
