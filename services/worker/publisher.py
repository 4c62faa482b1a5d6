"""Publishes a worker's session events to Redis: journal + live channel, batched.

`emit` (called by the session runners) only appends to a per-session buffer
and wakes the flusher; the flusher sends every buffered event of every session
in one pipelined round trip of `event_publish.lua` calls, one call per session.
Events of one session keep their order: the flusher is the only sender. The
flusher is a supervised loop: a failed batch is put back in front and retried by
the loop itself; anything else that escapes restarts it, with what it holds.
"""

from __future__ import annotations

import asyncio
import logging

from shared.backoff import Backoff
from shared.contracts import SessionEventSink
from shared.protocol.duplex import DuplexEvent, dumps
from shared.redis.store import PublishItem, SessionStore
from shared.supervised import SupervisedLoop

log = logging.getLogger(__name__)

# Not journaled: the first event (it carries the resume token on the wire, added
# by the API pod) and anything emitted before it (a refused open).
_UNJOURNALED = frozenset({"session.created"})
_CARRIES_SESSION = frozenset({"session.created", "session.updated"})


class RedisEventPublisher(SessionEventSink):
    def __init__(
        self,
        store: SessionStore,
        *,
        max_bytes: int,
        ttl_s: float,
        closed_ttl_s: float,
        sessions_key: str | None = None,
    ) -> None:
        self.store = store
        self.sessions_key = sessions_key  # the worker's set of sessions: closed ones leave it
        self.max_bytes = max_bytes
        self.ttl_ms = int(ttl_s * 1000)
        self.closed_ttl_ms = int(closed_ttl_s * 1000)
        self._pending: dict[str, list[PublishItem]] = {}
        self._created: set[str] = set()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop: SupervisedLoop | None = None
        self._backoff = Backoff()
        self.published = 0

    def emit(self, session_id: str, event: DuplexEvent) -> None:
        wire_type = event.wire_type
        if wire_type == "session.created":
            self._created.add(session_id)
        journaled = session_id in self._created and wire_type not in _UNJOURNALED
        session_json = dumps(event.session) if wire_type in _CARRIES_SESSION else b""  # type: ignore[attr-defined]
        item = PublishItem(event.to_json(), wire_type, journaled, session_json)
        self._pending.setdefault(session_id, []).append(item)
        if wire_type == "session.closed":
            self._created.discard(session_id)
        self._idle.clear()
        self._wake.set()

    def start(self) -> None:
        self._loop = SupervisedLoop("event-publisher", self._run).start()

    async def _run(self) -> None:
        if self._pending:
            self._wake.set()  # restarted with events in hand: send them first
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, {}
            try:
                await self._send(batch)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Redis is unreachable: put the batch back in front, retry after a pause
                log.warning(
                    "publishing %d sessions' events failed; retrying", len(batch), exc_info=True
                )
                for session_id, items in batch.items():
                    self._pending[session_id] = items + self._pending.get(session_id, [])
                await asyncio.sleep(self._backoff.next_delay())
                self._wake.set()
                continue
            self._backoff.reset()
            if not self._pending:
                self._idle.set()

    async def _send(self, batch: dict[str, list[PublishItem]]) -> None:
        if not batch:
            return
        await self.store.publish_many(
            batch, max_bytes=self.max_bytes, ttl_ms=self.ttl_ms, closed_ttl_ms=self.closed_ttl_ms
        )
        closed = [sid for sid, items in batch.items() if items[-1].wire_type == "session.closed"]
        if closed and self.sessions_key:
            await self.store.client.srem(self.sessions_key, *closed)
        self.published += sum(len(items) for items in batch.values())

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything emitted so far is in Redis."""
        async with asyncio.timeout(timeout):
            await self._idle.wait()

    async def stop(self) -> None:
        if self._loop is not None:
            try:
                await self.flush()
            except TimeoutError:
                log.warning("stopping with unpublished events")
            await self._loop.stop()
