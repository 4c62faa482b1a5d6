"""The live channel's message format: a small header per event ahead of its exact JSON.

A live message (`duplex:session:{SID}:live`) is one of three shapes, told apart by its
first byte, and `decode_live` reads any of them in one call into the union `LiveMessage`:

- `!...`: a `ControlNotice` (`!takeover`, `!moved`, `!lost`; and the API pod's hub's own
  `!catchup`, which never crosses Redis);
- `{...`: one bare event JSON, unsequenced: what an open's first reply reads
  (session.created, or the error refusing the open), the journal-overflow notice, or an
  older worker's event (its `server_event_seq`, if any, inside the JSON);
- a digit: one or more framed records, in order, written by event_publish.lua. Each is
  `<seq> <length> <type> <response id>\n<JSON>`: `seq` 0 for an event not journaled,
  `length` the JSON's bytes, the response id empty when the event has none. The JSON is
  exactly what the client gets (with `server_event_seq` on the duplex surface, without it
  on the openai surface), so the API pod routes a record on its header and sends its
  bytes without parsing them.

The journal (`duplex:session:{SID}:events`) holds one entry per publisher round: id
`<first seq>-1`, fields `last` (the round's last seq) and `data` (the round's journaled
records, framed exactly as in its live message), so a replay splits an entry with the same
`split` and routes its records as the pump does (`journal_entry_records`). An entry of an
older worker holds one event (`<seq>-1`, fields type, data): read as one record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import orjson

CONTROL_BYTE = ord("!")
#: live-channel messages that start with this byte are control notices, not events
CONTROL_PREFIX = b"!"
TAKEOVER_KIND = "takeover"
TAKEOVER = CONTROL_PREFIX + TAKEOVER_KIND.encode() + b" "
MOVED_KIND = "moved"
#: the worker to the session's sockets: the session's hash is gone from Redis (a failover
#: or a Redis that restarted empty lost it), so nothing it says can be journaled any more
LOST_KIND = "lost"
#: the API pod's hub to its subscribers: the pub/sub connection came back, catch up from
#: the journal (services/api/live.py); never published in Redis
CATCHUP_KIND = "catchup"
_SPACE, _NEWLINE = b" ", b"\n"


class LiveMessageError(ValueError):
    """A framed live message that does not split into whole records."""


class LiveRecord(NamedTuple):
    """One event of a live message or a journal entry, routable without its JSON parsed."""

    seq: int  # server_event_seq; 0 when the event is not journaled
    wire_type: str
    response_id: str | None
    data: bytes  # the exact JSON the client gets

    def to_bytes(self) -> bytes:
        """The record as event_publish.lua frames it (tests, and the format's reference)."""
        return encode_header(self.seq, len(self.data), self.wire_type, self.response_id or "") + (
            self.data
        )

    @classmethod
    def from_json(cls, data: bytes) -> LiveRecord:
        """A bare event JSON (the rare unframed shape): parsed for its routing fields."""
        event = orjson.loads(data)
        if not isinstance(event, dict):
            raise LiveMessageError("a bare live event must be a JSON object")
        seq = event.get("server_event_seq")
        response_id = event.get("response_id")
        return cls(
            seq if isinstance(seq, int) and seq > 0 else 0,
            str(event.get("type", "")),
            response_id if isinstance(response_id, str) else None,
            data,
        )


@dataclasses.dataclass(frozen=True)
class ControlNotice:
    """A control message on a session's live channel, beside its events:

    - `!takeover <attachment generation>`: a newer attachment took the session;
    - `!moved <owner generation> <worker id>`: the session now lives on that worker (a
      drain or a failover moved it); API pods send its commands there from now on;
    - `!lost 0`: the serving worker found the session's hash gone from Redis (lost in a
      failover, or with a Redis that restarted empty) and dropped it; its sockets tell
      their clients to start a new session;
    - `!catchup`: (the API pod's hub, not Redis) the pub/sub connection came back.
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

    @classmethod
    def lost(cls) -> ControlNotice:
        """The session's state is gone from Redis: its sockets end it (resync)."""
        return cls(LOST_KIND)

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
        return cls.read(data)

    @classmethod
    def read(cls, data: bytes) -> ControlNotice:
        """The notice a control message (one that starts with `!`) holds."""
        kind, _, rest = data[len(CONTROL_PREFIX) :].partition(b" ")
        generation, _, worker = rest.partition(b" ")
        return cls(kind.decode(), int(generation) if generation.isdigit() else 0, worker.decode())


#: what one live message holds: a control notice, or its events in order
LiveMessage = ControlNotice | list[LiveRecord]


def decode_live(message: bytes) -> LiveMessage:
    """A live message in one call: its control notice, or its events in order (raises
    `LiveMessageError`, or orjson's error for a bare event that is not JSON)."""
    if is_control(message):
        return ControlNotice.read(message)
    return split(message)


def header_token(value: str, what: str) -> str:
    """A type for a header: refused when it has a space or a line break (it would shift
    the header's fields); event types of ours never do."""
    if " " in value or "\n" in value:
        raise ValueError(f"a live {what} cannot hold a space or a line break: {value!r}")
    return value


def response_token(value: str | None) -> str:
    """A response id for a header: one with a line break is left out (the header ends at
    the first one); a space is fine, the id is the header's last field."""
    return "" if value is None or "\n" in value else value


def encode_header(seq: int, length: int, wire_type: str, response_id: str) -> bytes:
    return f"{seq} {length} {wire_type} {response_id}\n".encode()


def is_control(data: bytes) -> bool:
    return bool(data) and data[0] == CONTROL_BYTE


def split(message: bytes) -> list[LiveRecord]:
    """The records of a live message that is not a control notice, in order."""
    if message[:1] == b"{":
        return [LiveRecord.from_json(message)]
    records = []
    position, end = 0, len(message)
    find = message.find
    try:
        while position < end:
            newline = find(_NEWLINE, position)
            if newline < 0:
                raise LiveMessageError("no end of header")
            seq, size, wire_type, response_id = message[position:newline].split(_SPACE, 3)
            start = newline + 1
            stop = start + int(size)
            if stop > end or stop < start or seq[:1] == b"-":
                raise LiveMessageError("a record runs past the message")
            records.append(
                LiveRecord(
                    int(seq), wire_type.decode(), response_id.decode() or None, message[start:stop]
                )
            )
            position = stop
    except ValueError as exc:  # a missing field, a length or seq that is not a number
        raise LiveMessageError(f"not a live record at byte {position}: {exc}") from None
    return records


def entry_first_seq(entry_id: bytes | str) -> int:
    """The first seq a journal entry holds: its id's first part."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


def journal_entry_records(entry_id: bytes | str, fields: Mapping[bytes, bytes]) -> list[LiveRecord]:
    """The records of one journal entry, in seq order: a round's framed records, or the one
    event of an entry written by an older worker (its seq the entry id)."""
    if b"last" in fields:
        return split(fields[b"data"])
    rid = fields.get(b"rid")
    return [
        LiveRecord(
            entry_first_seq(entry_id),
            fields.get(b"type", b"").decode(),
            rid.decode() if rid is not None else None,
            fields[b"data"],
        )
    ]


def stamps_seq(meta: Mapping[str, str]) -> bool:
    """Was the session opened on the duplex surface (the config in its hash says so)? Only
    its events' JSON carries `server_event_seq`; the other surfaces' (OpenAI GA, Moshi's
    and GPT-Live's protocols) go without: what its worker, the janitor and a refused
    restore publish for it alike. The codec is imported here, not with the module: the
    readers of Redis (`duplex sessions`) use the store and must not load it."""
    from shared.protocol.duplex import SURFACE_DUPLEX, SURFACE_KEY

    try:
        config = orjson.loads(meta.get("config") or "{}")
    except orjson.JSONDecodeError:
        return True
    if not isinstance(config, dict):
        return True
    return (config.get(SURFACE_KEY) or SURFACE_DUPLEX) == SURFACE_DUPLEX
