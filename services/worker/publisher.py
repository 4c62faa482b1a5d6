"""Publishes a worker's session events to Redis: journal + live channel, batched, fenced.

`emit` (called by the session runners) only appends to a per-session buffer
and wakes the flusher; the flusher sends every buffered event of every session
in one pipelined round trip of `event_publish.lua` calls, one call per session.
Events of one session keep their order: the flusher is the only sender. The
flusher is a supervised loop: a failed batch is put back in front and retried by
the loop itself; anything else that escapes restarts it, with what it holds.

Fencing: each session's calls carry the owner generation this worker holds it at
(`set_owner`: 1 at open, the restored one after a move). A `[-2]` reply means another
worker owns the session now: its remaining events are dropped, nothing more is sent
for it, and `on_fenced(session_id)` (the manager's `drop`) forgets it locally.

Checkpoints: a durable event (`DURABLE`) marks its session dirty; when a batch is
taken, `snapshot(session_id)` (the manager's, synchronous) is called for each dirty
session of the batch and its checkpoint goes in the same call as the events, so it
matches the journal up to the call's last event. `write_checkpoint` sends a drain's
final checkpoint after the session's pending events.

A session's events of one round go out as one live message (event_publish.lua frames
them: shared/redis/live_message.py), each with its response's id in its header. An
openai-surface session (`set_owner(..., stamp_seq=False)`) publishes its JSON without
`server_event_seq`: GA's events have no such key; the seq still travels in the header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

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
#: events whose response's id is the `id` of their `response` object, not a top-level key
_RESPONSE_OBJECT = frozenset({"response.created", "response.done"})
#: events after which the session's checkpoint is written (its state changed durably)
DURABLE = frozenset(
    {
        "session.created",
        "session.updated",
        "conversation.item.added",
        "conversation.item.created",
        "conversation.item.done",
        "conversation.item.deleted",
        "conversation.item.truncated",
        "conversation.item.input_audio_transcription.completed",
        "input_audio_buffer.committed",
        "response.created",
        "response.done",
    }
)
FENCED, GONE = [-2], [-1]


def _response_id(event: DuplexEvent, wire_type: str) -> str | None:
    """The id of the response an event belongs to, for the live header: the API pod drops
    a cancelled response's queued audio by it (the openai surface's response events carry
    it only inside their `response` object)."""
    response_id = getattr(event, "response_id", None)
    if response_id is None and wire_type in _RESPONSE_OBJECT:
        response = getattr(event, "response", None)
        response_id = response.get("id") if isinstance(response, dict) else None
    return response_id if isinstance(response_id, str) else None


@dataclasses.dataclass
class _Final:
    """A drain's final checkpoint, sent after the session's pending events."""

    data: bytes
    done: asyncio.Future[bool]


class RedisEventPublisher(SessionEventSink):
    def __init__(
        self,
        store: SessionStore,
        *,
        max_bytes: int,
        ttl_s: float,
        closed_ttl_s: float,
        sessions_key: str | None = None,
        snapshot: Callable[[str], bytes | None] | None = None,
        on_fenced: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.sessions_key = sessions_key  # the worker's set of sessions: closed ones leave it
        self.max_bytes = max_bytes
        self.ttl_ms = int(ttl_s * 1000)
        self.closed_ttl_ms = int(closed_ttl_s * 1000)
        self.snapshot = snapshot
        self.on_fenced = on_fenced
        self._pending: dict[str, list[PublishItem]] = {}
        self._created: set[str] = set()
        self._owners: dict[str, int] = {}
        self._unstamped: set[str] = set()  # openai-surface sessions: no seq in their JSON
        self._dirty: set[str] = set()
        self._finals: dict[str, _Final] = {}
        self._kept: dict[str, bytes] = {}  # checkpoints of a failed batch, sent with its retry
        self._fenced: set[str] = set()  # sessions nothing is sent for any more
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop: SupervisedLoop | None = None
        self._backoff = Backoff()
        self.published = 0
        self.checkpoints = 0

    # ------------------------------------------------------------ the session host's side

    def attach_host(
        self,
        *,
        snapshot: Callable[[str], bytes | None],
        on_fenced: Callable[[str], None],
    ) -> None:
        """The manager's checkpoint source and its `drop`."""
        self.snapshot = snapshot
        self.on_fenced = on_fenced

    def set_owner(self, session_id: str, generation: int, *, stamp_seq: bool = True) -> None:
        """Fence the session's publishes on `generation` from now on; its events are
        journaled (a restored session has no session.created of its own here).
        `stamp_seq` False: the session is on the openai surface, its JSON has no seq."""
        self._owners[session_id] = generation
        self._created.add(session_id)
        self._fenced.discard(session_id)
        if stamp_seq:
            self._unstamped.discard(session_id)
        else:
            self._unstamped.add(session_id)

    def owner(self, session_id: str) -> int | None:
        return self._owners.get(session_id)

    def forget_session(self, session_id: str) -> None:
        """Send nothing more for the session (dropped or fenced out): its pending events
        are discarded and later ones ignored until it is owned here again."""
        self._fenced.add(session_id)
        self._pending.pop(session_id, None)
        self._owners.pop(session_id, None)
        self._unstamped.discard(session_id)
        self._created.discard(session_id)
        self._dirty.discard(session_id)
        final = self._finals.pop(session_id, None)
        if final is not None and not final.done.done():
            final.done.set_result(False)

    def emit(self, session_id: str, event: DuplexEvent) -> None:
        if session_id in self._fenced:
            return
        wire_type = event.wire_type
        if wire_type == "session.created":
            self._created.add(session_id)
        journaled = session_id in self._created and wire_type not in _UNJOURNALED
        session_json = dumps(event.session) if wire_type in _CARRIES_SESSION else b""  # type: ignore[attr-defined]
        item = PublishItem(
            event.to_json(), wire_type, journaled, session_json, _response_id(event, wire_type)
        )
        self._pending.setdefault(session_id, []).append(item)
        if wire_type in DURABLE:
            self._dirty.add(session_id)
        if wire_type == "session.closed":
            self._created.discard(session_id)
        self._idle.clear()
        self._wake.set()

    async def write_checkpoint(self, session_id: str, data: bytes) -> bool:
        """Store a drain's final checkpoint, after every event of the session emitted so
        far, fenced like them. False: another worker owns the session (nothing written)."""
        if session_id in self._fenced:
            return False
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        previous = self._finals.get(session_id)
        if previous is not None and not previous.done.done():
            previous.done.set_result(True)  # superseded: this one is written in its place
        self._finals[session_id] = _Final(data, done)
        self._dirty.discard(session_id)
        self._idle.clear()
        self._wake.set()
        return await done

    # ------------------------------------------------------------ the flusher

    def start(self) -> None:
        self._loop = SupervisedLoop("event-publisher", self._run).start()

    def _take(self) -> tuple[dict[str, list[PublishItem]], dict[str, bytes], dict[str, _Final]]:
        """The batch, and the checkpoints that go with it, taken at one instant."""
        batch, self._pending = self._pending, {}
        finals, self._finals = self._finals, {}
        for session_id in finals:
            batch.setdefault(session_id, [])
        kept, self._kept = self._kept, {}
        checkpoints = {sid: final.data for sid, final in finals.items()}
        for session_id in batch:
            if session_id in checkpoints:
                self._dirty.discard(session_id)
            elif session_id in self._dirty:
                self._dirty.discard(session_id)
                data = self._snapshot(session_id)
                if data is not None:
                    checkpoints[session_id] = data
                elif session_id in kept:
                    checkpoints[session_id] = kept[session_id]
            elif session_id in kept:
                checkpoints[session_id] = kept[session_id]
        return batch, checkpoints, finals

    def _snapshot(self, session_id: str) -> bytes | None:
        if self.snapshot is None:
            return None
        try:
            return self.snapshot(session_id)
        except Exception:
            log.exception("checkpoint of session %s failed; its events go without", session_id)
            return None

    async def _run(self) -> None:
        if self._pending or self._finals:
            self._wake.set()  # restarted with events in hand: send them first
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, checkpoints, finals = self._take()
            try:
                await self._send(batch, checkpoints, finals)
            except asyncio.CancelledError:
                self._put_back(batch, checkpoints, finals)
                raise
            except Exception:
                # Redis is unreachable: put the batch back in front, retry after a pause
                log.warning(
                    "publishing %d sessions' events failed; retrying", len(batch), exc_info=True
                )
                self._put_back(batch, checkpoints, finals)
                await asyncio.sleep(self._backoff.next_delay())
                self._wake.set()
                continue
            self._backoff.reset()
            if not self._pending and not self._finals:
                self._idle.set()

    def _put_back(
        self,
        batch: dict[str, list[PublishItem]],
        checkpoints: dict[str, bytes],
        finals: dict[str, _Final],
    ) -> None:
        """A batch that failed goes back in front, its checkpoints with it: a session's
        checkpoint taken then is still the one matching those events (a later batch of the
        session marks it dirty again and takes a newer one)."""
        for session_id, items in batch.items():
            if session_id in self._fenced:
                continue
            self._pending[session_id] = items + self._pending.get(session_id, [])
            final = finals.get(session_id)
            if final is not None:
                newer = self._finals.get(session_id)
                if newer is None:
                    self._finals[session_id] = final
                elif not final.done.done():
                    final.done.set_result(True)  # superseded by the newer final checkpoint
            elif session_id in checkpoints:
                self._kept[session_id] = checkpoints[session_id]

    async def _send(
        self,
        batch: dict[str, list[PublishItem]],
        checkpoints: dict[str, bytes],
        finals: dict[str, _Final],
    ) -> None:
        if not batch:
            return
        replies = await self.store.publish_many(
            batch,
            max_bytes=self.max_bytes,
            ttl_ms=self.ttl_ms,
            closed_ttl_ms=self.closed_ttl_ms,
            owners={sid: self._owners[sid] for sid in batch if sid in self._owners},
            checkpoints=checkpoints,
            unstamped=self._unstamped,
        )
        closed = []
        for session_id, items in batch.items():
            reply = replies.get(session_id, [])
            fenced = reply == FENCED
            final = finals.get(session_id)
            if final is not None and not final.done.done():
                final.done.set_result(reply not in (FENCED, GONE))
            if fenced:
                self._fenced_out(session_id, len(items))
                continue
            self.published += len(items)
            self.checkpoints += session_id in checkpoints
            if items and items[-1].wire_type == "session.closed":
                closed.append(session_id)
                self._owners.pop(session_id, None)
                self._unstamped.discard(session_id)
        if closed and self.sessions_key:
            await self.store.client.srem(self.sessions_key, *closed)

    def _fenced_out(self, session_id: str, refused: int) -> None:
        dropped = len(self._pending.get(session_id, []))
        log.warning(
            "session %s: refused at owner generation %s (another worker owns it now); "
            "dropping it here with %d unsent events",
            session_id,
            self._owners.get(session_id),
            refused + dropped,
        )
        self.forget_session(session_id)
        if self.on_fenced is not None:
            try:
                self.on_fenced(session_id)
            except Exception:
                log.exception("dropping fenced-out session %s failed", session_id)

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
