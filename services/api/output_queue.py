"""A connection's bounded send queue, with the seed's overflow policy.

- Ordinary events fit within `max_bytes` / `max_events` (2 MiB / 512 by default;
  bytes are the compact JSON, base64 audio included).
- Errors and response endings may also use a reserve (64 KiB / 8 events), so a
  slow consumer still learns how its response ended.
- The final closure notice (session.closed / session.expired / session.replaced)
  has its own slot and is never refused.
- When an ordinary event does not fit, the queue is `overflowed`: later
  ordinary events are suppressed (the connection then closes the session).
- An accepted cancel removes the still-queued audio deltas of that response.

Most sockets sit idle with nothing queued, so an idle queue holds no deque and no waiter
list (services/api/waitables.py): the deque exists while items are queued.
"""

from __future__ import annotations

import collections
import dataclasses

from services.api.waitables import Flag
from shared.protocol.duplex import MOSHI_AUDIO

PRIORITY_TYPES = frozenset(
    {"error", "response.done", "rate_limits.updated", "session.resync_required"}
)
CLOSURE_TYPES = frozenset({"session.closed", "session.expired", "session.replaced"})
AUDIO_DELTA = "response.output_audio.delta"
#: a response's audio, which a cancel drops from the queue: the JSON deltas, and a moshi
#: session's audio records (its pcm16 bytes)
AUDIO_TYPES = frozenset({AUDIO_DELTA, MOSHI_AUDIO})


@dataclasses.dataclass(slots=True)
class OutItem:
    data: bytes
    wire_type: str
    response_id: str | None = None


class OutputQueue:
    __slots__ = (
        "_closure",
        "_empty",
        "_items",
        "_ready",
        "bytes",
        "max_bytes",
        "max_events",
        "overflowed",
        "reserve_bytes",
        "reserve_events",
    )

    def __init__(
        self, max_bytes: int, max_events: int, reserve_bytes: int, reserve_events: int
    ) -> None:
        self.max_bytes, self.max_events = max_bytes, max_events
        self.reserve_bytes, self.reserve_events = reserve_bytes, reserve_events
        self._items: collections.deque[OutItem] | None = None  # None while nothing is queued
        self._closure: OutItem | None = None
        self.bytes = 0
        self.overflowed = False
        self._ready = Flag()
        self._empty = Flag(True)  # set while nothing is queued (`drained`)

    def __len__(self) -> int:
        return self._count() + (self._closure is not None)

    def _count(self) -> int:
        return len(self._items) if self._items is not None else 0

    def put(self, item: OutItem) -> bool:
        """Queue an item; False when it was refused (overflow or suppressed)."""
        if item.wire_type in CLOSURE_TYPES:
            if self._closure is None:
                self._closure = item
                self._ready.set()
                self._empty.clear()
            return True
        priority = item.wire_type in PRIORITY_TYPES
        if self.overflowed and not priority:
            return False
        size = len(item.data)
        extra_bytes = self.reserve_bytes if priority else 0
        extra_events = self.reserve_events if priority else 0
        if (
            self.bytes + size > self.max_bytes + extra_bytes
            or self._count() + 1 > self.max_events + extra_events
        ):
            if not priority:
                self.overflowed = True
            return False
        if item.wire_type == "response.done" and b'"status":"cancelled"' in item.data:
            self.drop_audio(item.response_id)
        if self._items is None:
            self._items = collections.deque()
        self._items.append(item)
        self.bytes += size
        self._ready.set()
        self._empty.clear()
        return True

    def drop_audio(self, response_id: str | None) -> int:
        """Remove queued audio deltas of a cancelled response; other events keep FIFO order."""
        if response_id is None or self._items is None:
            return 0
        kept: collections.deque[OutItem] = collections.deque()
        dropped = 0
        for item in self._items:
            if item.wire_type in AUDIO_TYPES and item.response_id == response_id:
                self.bytes -= len(item.data)
                dropped += 1
            else:
                kept.append(item)
        self._items = kept or None
        self._note_if_empty()
        return dropped

    async def get(self) -> OutItem:
        """The next item; the closure notice comes after everything queued before it."""
        while True:
            if self._items is not None:
                item = self._items.popleft()
                if not self._items:
                    self._items = None  # freed: an idle queue holds no deque
                self.bytes -= len(item.data)
                self._note_if_empty()
                return item
            if self._closure is not None:
                item, self._closure = self._closure, None
                self._note_if_empty()
                return item
            self._ready.clear()
            await self._ready.wait()

    async def drained(self) -> None:
        """Return once every queued item has been taken by `get` (the writer)."""
        await self._empty.wait()

    def _note_if_empty(self) -> None:
        if self._items is None and self._closure is None:
            self._empty.set()
