"""Which sessions a worker owns: taking one over (`restore`), taking back those its previous
process left (`adopt`), and letting go of those it lost while it was stalled (`check_owners`).

Restore (inbox kind `restore`, `RestoreRequest`): a drain or the dead-worker sweep moved a
session here under a new owner generation. The worker reads the session's checkpoint and
the manager rebuilds the session from it (admission as an open, no `session.created`); the
command order starts from the checkpoint's `applied` mark; the session joins the worker's
session set (the set the dead-worker sweep reads) and the load is reported. A request that
is stale (the session has moved on, or closed, since it was written) is ignored. A refusal
(no room, no checkpoint, a checkpoint that does not restore) ends the session the way a
lost worker does: `error{worker_lost}` and `session.closed{worker_lost}`, fenced on the
request's owner generation, so nothing is written when another owner has it meanwhile.

Zombie check: a heartbeat whose ZADD adds the worker anew means the dead-worker sweep
removed it (it stalled past the heartbeat TTL): its sessions may have been re-placed. Every
session it still holds is checked against the meta hash; those whose owner (worker, owner
generation) is not this worker any more, or that are closed, are dropped without an event.
The rest go back into the session set the sweep deleted.

`Ownership` is given exactly what it uses (the store, the session table and moves, the
publisher's limits, how to publish a notice and report the load) by the worker process,
its composition root.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from services.worker.control.moves import SessionMoves
from services.worker.publisher import RedisEventPublisher
from shared.contracts import DuplexSessionError
from shared.protocol.duplex import DuplexErrorEvent, SessionClosed
from shared.protocol.duplex.errors import WORKER_LOST
from shared.redis.boundary import ControlNotice, RestoreRequest
from shared.redis.inbox_stripes import InboxStripes, create_groups, delete_worker_keys
from shared.redis.live_message import stamps_seq
from shared.redis.store import PublishItem, SessionStore

log = logging.getLogger(__name__)


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


#: publishes a control notice on a session's live channel (SPUBLISH on a cluster)
Notify = Callable[[str, ControlNotice], Awaitable[None]]


class Ownership:
    def __init__(
        self,
        worker_id: str,
        store: SessionStore,
        moves: SessionMoves,
        publisher: RedisEventPublisher,
        *,
        notify: Notify,
        report_load: Callable[[], Awaitable[None]],
    ) -> None:
        self.worker_id = worker_id
        self.store = store
        self.keys = store.keys
        self.moves = moves
        self.publisher = publisher
        #: the worker's inbox stripes (its process sets them once it has chosen them)
        self.stripes = InboxStripes()
        self.notify = notify
        self.report_load = report_load

    async def restore(self, request: RestoreRequest) -> bool:
        """Take the session over from its checkpoint; False when it was refused or stale."""
        sid = request.session_id
        client = self.store.client
        owner, generation, state = await client.hmget(
            self.keys.session(sid), ["worker", "owner_generation", "state"]
        )
        if (
            _text(owner) != self.worker_id
            or _text(generation) != str(request.owner_generation)
            or _text(state) in ("", "closed")
        ):
            log.info(
                "restore of session %s at owner generation %d ignored: it is on %r at %r (%s) now",
                sid,
                request.owner_generation,
                _text(owner),
                _text(generation),
                _text(state) or "gone",
            )
            return False
        state = await self.store.restore_state(sid)
        checkpoint = state.checkpoint
        if checkpoint is None:
            await self.refuse(request, "it has no checkpoint")
            return False
        try:
            applied = await self.moves.restore(
                sid,
                checkpoint,
                owner_generation=request.owner_generation,
                reason=request.reason,
                model_history=state.model_history,
                model_record_bytes=state.model_record_bytes,
                journaled_seq=state.next_seq,
            )
        except DuplexSessionError as exc:
            await self.refuse(request, f"{exc.code}: {exc.message}")
            return False
        except Exception as exc:  # a stage or plugin that failed: the session must not be orphaned
            log.exception("restoring session %s failed", sid)
            await self.refuse(request, f"internal_error: {exc}")
            return False
        await client.sadd(self.keys.worker_sessions(self.worker_id), sid)
        await self.store.mark_restored(sid)
        await self.report_load()
        log.debug(
            "session %s taken over from %s (%s, owner generation %d, applied %s)",
            sid,
            request.from_worker or "?",
            request.reason,
            request.owner_generation,
            tuple(applied),
        )
        return True

    async def refuse(self, request: RestoreRequest, why: str) -> None:
        """No worker could take the session: it closes with worker_lost, fenced on the request's
        owner generation (nothing is written if the session has another owner by now)."""
        sid = request.session_id
        log.warning("restore of session %s refused (%s): closing it with worker_lost", sid, why)
        error = DuplexErrorEvent.for_code(
            WORKER_LOST,
            f"the session's worker {request.from_worker or ''} went away and no worker could take "
            f"the session ({why}); open a new session",
        )
        closed = SessionClosed(session_id=sid, reason=WORKER_LOST)
        publisher = self.publisher
        seqs = await self.store.publish(
            sid,
            [PublishItem(event.to_json(), event.wire_type) for event in (error, closed)],
            max_bytes=publisher.max_bytes,
            ttl_ms=publisher.ttl_ms,
            closed_ttl_ms=publisher.closed_ttl_ms,
            owner_generation=request.owner_generation,
            # only a duplex-surface session's JSON carries server_event_seq
            stamp_seq=stamps_seq(await self.store.meta(sid)),
        )
        if seqs in ([-1], [-2]):
            return
        client = self.store.client
        await client.srem(self.keys.worker_sessions(self.worker_id), sid)
        await client.zrem(self.keys.leases(), sid)  # a detached session's grace ends here too

    async def adopt(self) -> list[str]:
        """At start: the sessions a previous process under this worker id left (it was killed
        and restarted faster than the heartbeat TTL, so the dead-worker sweep never saw it
        dead) are restored here from their checkpoints under a new owner generation, which
        fences the old process out should it still run. The inbox entries that process left
        unhandled are read next (the consume loop starts from its pending entries) and their
        marks order them. A session that cannot be restored closes with worker_lost. Returns
        the restored ones."""
        client = self.store.client
        members = await client.smembers(self.keys.worker_sessions(self.worker_id))
        restored: list[str] = []
        if not members:
            return restored
        await self._adopt([_text(m) for m in sorted(members)], restored)
        log.warning(
            "worker %s started with %d sessions of its previous process: %d restored from "
            "their checkpoints",
            self.worker_id,
            len(members),
            len(restored),
        )
        return restored

    async def _adopt(self, sids: list[str], restored: list[str]) -> None:
        client = self.store.client
        for sid in sids:
            owner, current, state = await client.hmget(
                self.keys.session(sid), ["worker", "owner_generation", "state"]
            )
            if _text(owner) != self.worker_id or _text(state) not in ("active", "detached"):
                await client.srem(self.keys.worker_sessions(self.worker_id), sid)
                continue
            generation = await self.store.move_owner(
                sid,
                self.worker_id,
                self.worker_id,
                WORKER_LOST,
                expected_generation=int(_text(current) or 1),
            )
            if not generation:
                continue  # the sweep moved it meanwhile
            request = RestoreRequest(sid, generation, WORKER_LOST, self.worker_id)
            try:
                taken = await self.restore(request)
            except Exception:  # one session must not keep the worker from starting
                log.exception("taking back session %s failed", sid)
                continue
            if taken:
                restored.append(sid)
                notice = ControlNotice.moved(generation, self.worker_id)
                # SPUBLISH on a cluster: to the shard that owns the channel
                await self.notify(sid, notice)

    async def rejoined(self) -> list[str]:
        """Added to the registry anew while holding sessions: the dead-worker sweep removed the
        worker (a stall past the TTL) and deleted its inbox. The inbox's group is made again,
        and the sessions that are not its own any more are dropped (`check_owners`)."""
        await create_groups(self.store.client, self.keys, self.worker_id, self.stripes)
        return await self.check_owners()

    async def check_owners(self) -> list[str]:
        """After the sweep removed this worker: drop the sessions it does not own any more.
        Returns the dropped ones."""
        owned = self.moves.owned_sessions()
        if not owned:
            return []
        client = self.store.client
        dropped, kept = [], []
        for sid, generation in owned.items():
            owner, current, state = await client.hmget(
                self.keys.session(sid), ["worker", "owner_generation", "state"]
            )
            if (
                _text(owner) == self.worker_id
                and _text(current) == str(generation)
                and _text(state) not in ("", "closed")
            ):
                kept.append(sid)
                continue
            why = (
                f"the dead-worker sweep removed this worker; the session is on {_text(owner)!r} "
                f"at owner generation {_text(current) or '?'} ({_text(state) or 'gone'}), not on "
                f"this worker at {generation}"
            )
            self.moves.drop(sid, why)
            dropped.append(sid)
        if kept:
            await client.sadd(self.keys.worker_sessions(self.worker_id), *kept)
        log.warning(
            "worker %s was added to the registry anew (the dead-worker sweep removed it after a "
            "stall, or Redis restarted): %d sessions it held are not its own any more and were "
            "dropped, %d are",
            self.worker_id,
            len(dropped),
            len(kept),
        )
        return dropped

    async def leave(self) -> None:
        """The last step of a stop: remove the registration, inbox and session set, unless a
        session still lists this worker as its owner without being held here (a drain handed
        it over while this worker was already leaving, or a move of ours failed half-way).
        Then the worker stays in the registry as dead (score 1), its session set and inbox
        kept: the dead-worker sweep fails those sessions over from their checkpoints at its
        next tick. The registry entry was removed before the set is read, so a drain that
        hands a session over after the read sees this worker gone and moves it on itself
        (services/worker/handover.py)."""
        client = self.store.client
        orphans = []
        for member in await client.smembers(self.keys.worker_sessions(self.worker_id)):
            sid = _text(member)
            owner, state = await client.hmget(self.keys.session(sid), ["worker", "state"])
            if _text(owner) == self.worker_id and _text(state) in ("active", "detached"):
                orphans.append(sid)
        if orphans:
            log.warning(
                "leaving %d sessions that still name this worker to the dead-worker sweep: %s",
                len(orphans),
                ", ".join(sorted(orphans)),
            )
            await client.zadd(self.keys.workers(), {self.worker_id: 1})
            return
        # the inbox too: its sessions are closed or moved, and nothing reads it again
        await delete_worker_keys(client, self.keys, self.worker_id, self.stripes)
