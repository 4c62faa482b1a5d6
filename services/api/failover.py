"""Failover: the dead-worker sweep puts a dead worker's sessions on live workers.

For a dead worker D (its heartbeat older than the TTL) the janitor reads D's whole inbox
once (`Failover.begin`), then hands each of D's sessions to `Failover.move`. A session that
is active or detached and has a checkpoint (`duplex:session:{SID}:checkpoint`, written by
its worker) goes to the first live worker the placement ring gives with room (D excluded;
a draining worker takes nothing), B:

1. owner_move.lua: the hash's `worker` becomes B under a new owner generation, so D, should
   it come back, is fenced out of every write (0: another sweep or a newer owner moved it
   first: it is left alone);
2. SADD B's session set (the set the next sweep reads, should B die too);
3. a `restore` entry (`RestoreRequest`, reason `worker_lost`) into B's inbox;
4. D's entries of the session that D never handled (command, touch, close), in stream
   order and with their fields unchanged: their (attachment, seq) marks let B drop what
   the checkpoint already applied and tell the client what is missing (`input_lost`);
5. `!moved <owner generation> <B>` on the session's live channel (SPUBLISH on a cluster,
   where the API pods listen with SSUBSCRIBE): API pods send its commands to B from now on.

A detached session keeps its lease (it is still in its disconnect grace). A session in
state opening is not moved (its opener hears worker_lost); one without a checkpoint, or
with no live worker that has room, is `Outcome.CLOSE`: the janitor ends it with worker_lost.

An API pod that has not heard the `moved` notice yet still writes to D's inbox:
`Failover.finish` reads what came after the first read and forwards those entries too,
just before the janitor deletes D's keys.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from shared.protocol.duplex.errors import WORKER_LOST
from shared.redis.boundary import (
    FORWARDED_KINDS,
    ControlNotice,
    InboxMessage,
    RestoreRequest,
    decode_entry,
)
from shared.redis.keys import KeySchema
from shared.redis.placement import WorkerDirectory
from shared.redis.store import SessionStore

log = logging.getLogger(__name__)

#: the session states a failover moves (opening: the opener's; closed: nothing to move)
MOVABLE_STATES = frozenset({"active", "detached"})

Fields = dict[bytes, bytes]
#: a notice on a live channel (the pod's `LiveHub.publish`: SPUBLISH on a cluster)
Publish = Callable[[str, bytes], Awaitable[None]]


class Outcome(enum.Enum):
    MOVED = "moved"  # on a live worker now
    LEFT = "left"  # not the dead worker's any more (moved by another, closed, gone)
    CLOSE = "close"  # cannot be moved: the janitor closes it with worker_lost


@dataclasses.dataclass
class WorkerLoss:
    """One dead worker's sweep: its unhandled inbox entries by session, and the moves."""

    dead: str
    entries: dict[str, list[InboxMessage]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )
    #: the last entry read of each of its inbox's stripes
    last_ids: dict[int, str] = dataclasses.field(default_factory=dict)
    moved: dict[str, str] = dataclasses.field(default_factory=dict)  # session -> new worker
    placed: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def take(self, stripe: int, entries: list[tuple[Any, Fields]]) -> None:
        for entry_id, fields in entries:
            self.last_ids[stripe] = _text(entry_id)
            for message in _messages(entry_id, fields):
                if isinstance(message, FORWARDED_KINDS):
                    self.entries[message.session_id].append(message)


def _text(entry_id: Any) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def _messages(entry_id: Any, fields: Fields) -> list[InboxMessage]:
    """An entry's messages: an API pod's entry (many sessions' commands) is split, so each
    session's go to its new worker."""
    try:
        return decode_entry(fields)
    except Exception:  # no API pod wrote it: nothing of it is forwarded
        log.warning("inbox entry %r of a dead worker does not decode: dropped", entry_id)
        return []


class Failover:
    def __init__(
        self,
        client: Any,
        keys: KeySchema,
        store: SessionStore,
        directory: WorkerDirectory,
        publish: Publish,
    ) -> None:
        self.client = client
        self.keys = keys
        self.store = store
        self.directory = directory
        self.publish = publish

    async def begin(self, dead: str) -> WorkerLoss:
        """Read the dead worker's whole inbox (what it never handled), once: every stripe
        (a session's messages are all in one of them: shared/redis/inbox_stripes.py)."""
        loss = WorkerLoss(dead)
        for stripe in (await self.store.stripes.of(dead)).stripes:
            loss.take(stripe, await self.client.xrange(self.keys.inbox(dead, stripe)))
        return loss

    async def move(self, loss: WorkerLoss, session_id: str, meta: dict[str, str]) -> Outcome:
        """Re-place one session of the dead worker from its checkpoint (`meta`: its hash)."""
        if meta.get("worker") != loss.dead or meta.get("state") == "closed":
            return Outcome.LEFT
        if meta.get("state") not in MOVABLE_STATES:
            return Outcome.CLOSE
        if not await self.client.exists(self.keys.checkpoint(session_id)):
            return Outcome.CLOSE
        target = await self._target(loss, session_id, meta.get("model") or None)
        if target is None:
            return Outcome.CLOSE
        # fenced on the owner generation read: a worker restarted under the dead one's id
        # that took the session back meanwhile (`adopt`) keeps it
        expected = int(meta["owner_generation"]) if meta.get("owner_generation") else None
        generation = await self.store.move_owner(
            session_id, loss.dead, target, WORKER_LOST, expected_generation=expected
        )
        if not generation:
            return Outcome.LEFT  # another sweep (or a newer owner) moved it first
        loss.placed[target] += 1
        loss.moved[session_id] = target
        await self.client.sadd(self.keys.worker_sessions(target), session_id)
        restore = RestoreRequest(session_id, generation, WORKER_LOST, loss.dead)
        await self.store.inbox_append(target, restore.to_fields(), session_id=session_id)
        entries = loss.entries.pop(session_id, [])
        await self.store.inbox_forward(target, session_id, entries)
        notice = ControlNotice.moved(generation, target).to_bytes()
        await self.publish(self.keys.live(session_id), notice)
        log.info(
            "session %s of dead worker %s moved to %s (owner generation %d, %d inbox "
            "entries forwarded)",
            session_id,
            loss.dead,
            target,
            generation,
            len(entries),
        )
        return Outcome.MOVED

    async def finish(self, loss: WorkerLoss) -> None:
        """Forward the entries of moved sessions that reached the dead worker's inbox after
        it was read (their API pod had not heard the move yet). The caller deletes it next."""
        if not loss.moved:
            return
        late = WorkerLoss(loss.dead)
        for stripe in (await self.store.stripes.of(loss.dead)).stripes:
            last = loss.last_ids.get(stripe)
            start = "-" if last is None else f"({last}"
            late.take(
                stripe, await self.client.xrange(self.keys.inbox(loss.dead, stripe), start, "+")
            )
        for session_id, entries in late.entries.items():
            if (target := loss.moved.get(session_id)) is not None:
                await self.store.inbox_forward(target, session_id, entries)
                log.info(
                    "%d late inbox entries of session %s forwarded to %s",
                    len(entries),
                    session_id,
                    target,
                )

    async def _target(self, loss: WorkerLoss, session_id: str, model: str | None) -> str | None:
        return await self.directory.first_with_room(
            model, session_id, frozenset({loss.dead}), loss.placed
        )
