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
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from redis import exceptions as redis_errors

from shared.contracts import DuplexSessionError
from shared.protocol.duplex import DuplexErrorEvent, SessionClosed
from shared.redis.boundary import ControlNotice, RestoreRequest
from shared.redis.keys import INBOX_GROUP
from shared.redis.live_message import openai_surface
from shared.redis.store import PublishItem

if TYPE_CHECKING:
    from services.worker.host import WorkerHost

log = logging.getLogger(__name__)

WORKER_LOST = "worker_lost"


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


async def restore(worker: WorkerHost, request: RestoreRequest) -> bool:
    """Take the session over from its checkpoint; False when it was refused or stale."""
    sid = request.session_id
    client = worker.redis.client
    owner, generation, state = await client.hmget(
        worker.keys.session(sid), ["worker", "owner_generation", "state"]
    )
    if (
        _text(owner) != worker.worker_id
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
    checkpoint = await worker.store.checkpoint(sid)
    if checkpoint is None:
        await refuse(worker, request, "it has no checkpoint")
        return False
    try:
        applied = await worker.manager.restore(
            sid,
            checkpoint,
            owner_generation=request.owner_generation,
            reason=request.reason,
        )
    except DuplexSessionError as exc:
        await refuse(worker, request, f"{exc.code}: {exc.message}")
        return False
    except Exception as exc:  # a stage or plugin that failed: the session must not be orphaned
        log.exception("restoring session %s failed", sid)
        await refuse(worker, request, f"internal_error: {exc}")
        return False
    worker.order.restored(sid, tuple(applied))  # type: ignore[arg-type]
    await client.sadd(worker.keys.worker_sessions(worker.worker_id), sid)
    await worker.store.mark_restored(sid)
    await worker.report_load()
    log.debug(
        "session %s taken over from %s (%s, owner generation %d, applied %s)",
        sid,
        request.from_worker or "?",
        request.reason,
        request.owner_generation,
        tuple(applied),
    )
    return True


async def refuse(worker: WorkerHost, request: RestoreRequest, why: str) -> None:
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
    publisher = worker.publisher
    seqs = await worker.store.publish(
        sid,
        [PublishItem(event.to_json(), event.wire_type) for event in (error, closed)],
        max_bytes=publisher.max_bytes,
        ttl_ms=publisher.ttl_ms,
        closed_ttl_ms=publisher.closed_ttl_ms,
        owner_generation=request.owner_generation,
        # an openai-surface session's JSON goes without server_event_seq (GA has none)
        stamp_seq=not openai_surface(await worker.store.meta(sid)),
    )
    if seqs in ([-1], [-2]):
        return
    client = worker.redis.client
    await client.srem(worker.keys.worker_sessions(worker.worker_id), sid)
    await client.zrem(worker.keys.leases(), sid)  # a detached session's grace ends here too


async def adopt(worker: WorkerHost) -> list[str]:
    """At start: the sessions a previous process under this worker id left (it was killed
    and restarted faster than the heartbeat TTL, so the dead-worker sweep never saw it
    dead) are restored here from their checkpoints under a new owner generation, which
    fences the old process out should it still run. The inbox entries that process left
    unhandled are read next (the consume loop starts from its pending entries) and their
    marks order them. A session that cannot be restored closes with worker_lost. Returns
    the restored ones."""
    client = worker.redis.client
    members = await client.smembers(worker.keys.worker_sessions(worker.worker_id))
    restored: list[str] = []
    if not members:
        return restored
    await _adopt(worker, [_text(m) for m in sorted(members)], restored)
    log.warning(
        "worker %s started with %d sessions of its previous process: %d restored from "
        "their checkpoints",
        worker.worker_id,
        len(members),
        len(restored),
    )
    return restored


async def _adopt(worker: WorkerHost, sids: list[str], restored: list[str]) -> None:
    client = worker.redis.client
    for sid in sids:
        owner, current, state = await client.hmget(
            worker.keys.session(sid), ["worker", "owner_generation", "state"]
        )
        if _text(owner) != worker.worker_id or _text(state) not in ("active", "detached"):
            await client.srem(worker.keys.worker_sessions(worker.worker_id), sid)
            continue
        generation = await worker.store.move_owner(
            sid,
            worker.worker_id,
            worker.worker_id,
            WORKER_LOST,
            expected_generation=int(_text(current) or 1),
        )
        if not generation:
            continue  # the sweep moved it meanwhile
        request = RestoreRequest(sid, generation, WORKER_LOST, worker.worker_id)
        try:
            taken = await restore(worker, request)
        except Exception:  # one session must not keep the worker from starting
            log.exception("taking back session %s failed", sid)
            continue
        if taken:
            restored.append(sid)
            notice = ControlNotice.moved(generation, worker.worker_id)
            # SPUBLISH on a cluster: to the shard that owns the channel
            await worker.redis.publish(worker.keys.live(sid), notice.to_bytes())


async def rejoined(worker: WorkerHost) -> list[str]:
    """Added to the registry anew while holding sessions: the dead-worker sweep removed the
    worker (a stall past the TTL) and deleted its inbox. The inbox's group is made again,
    and the sessions that are not its own any more are dropped (`check_owners`)."""
    with contextlib.suppress(redis_errors.ResponseError):  # BUSYGROUP: it exists
        await worker.redis.client.xgroup_create(worker.inbox, INBOX_GROUP, id="0", mkstream=True)
    return await check_owners(worker)


async def check_owners(worker: WorkerHost) -> list[str]:
    """After the sweep removed this worker: drop the sessions it does not own any more.
    Returns the dropped ones."""
    owned = worker.manager.owned_sessions()
    if not owned:
        return []
    client = worker.redis.client
    dropped, kept = [], []
    for sid, generation in owned.items():
        owner, current, state = await client.hmget(
            worker.keys.session(sid), ["worker", "owner_generation", "state"]
        )
        if (
            _text(owner) == worker.worker_id
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
        worker.manager.drop(sid, why)
        worker.order.forget(sid)
        dropped.append(sid)
    if kept:
        await client.sadd(worker.keys.worker_sessions(worker.worker_id), *kept)
    log.warning(
        "worker %s was added to the registry anew (the dead-worker sweep removed it after a "
        "stall, or Redis restarted): %d sessions it held are not its own any more and were "
        "dropped, %d are",
        worker.worker_id,
        len(dropped),
        len(kept),
    )
    return dropped


async def leave(worker: WorkerHost) -> None:
    """The last step of a stop: remove the registration, inbox and session set, unless a
    session still lists this worker as its owner without being held here (a drain handed
    it over while this worker was already leaving, or a move of ours failed half-way).
    Then the worker stays in the registry as dead (score 1), its session set and inbox
    kept: the dead-worker sweep fails those sessions over from their checkpoints at its
    next tick. The registry entry was removed before the set is read, so a drain that
    hands a session over after the read sees this worker gone and moves it on itself
    (services/worker/handover.py)."""
    client = worker.redis.client
    orphans = []
    for member in await client.smembers(worker.keys.worker_sessions(worker.worker_id)):
        sid = _text(member)
        owner, state = await client.hmget(worker.keys.session(sid), ["worker", "state"])
        if _text(owner) == worker.worker_id and _text(state) in ("active", "detached"):
            orphans.append(sid)
    if orphans:
        log.warning(
            "leaving %d sessions that still name this worker to the dead-worker sweep: %s",
            len(orphans),
            ", ".join(sorted(orphans)),
        )
        await client.zadd(worker.keys.workers(), {worker.worker_id: 1})
        return
    # the inbox too: its sessions are closed or moved, and nothing reads it again
    await client.delete(
        worker.keys.worker(worker.worker_id),
        worker.keys.worker_sessions(worker.worker_id),
        worker.inbox,
        worker.keys.inbox_bytes(worker.worker_id),
    )
