"""Handing a drained session to its new worker, once its final checkpoint is in Redis.

`hand_over` runs the steps of a move that follow the old worker's final checkpoint: the
owner CAS (owner_move.lua), the session sets, the `restore` entry in the new worker's
inbox and the `!moved` notice. Each step is retried on a Redis error (a failover of the
Redis primary, a dropped connection): the session is already gone from this worker's
memory, so giving up half-way would leave it on no worker at all. A CAS whose reply was
lost is recognised on the retry (the session is on the target at the next generation).

The target can itself be shutting down: it was live and not draining when it was chosen,
but its drain may have ended before it read the restore entry. When the target has left
the registry after the entry was written, the session is moved on once more (fenced on
the generation just given), so it never waits in an inbox no one reads. Should every step
fail, the session stays in this worker's set with its final checkpoint: the worker then
leaves itself for the dead-worker sweep to fail over (`WorkerProcess.stop`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from shared.redis.boundary import ControlNotice, RestoreRequest
from shared.redis.store import SessionStore

log = logging.getLogger(__name__)

T = TypeVar("T")
WHY = "drain"
ATTEMPTS = 5
FIRST_PAUSE_S = 0.1
#: how many times a session is moved on when its target left before reading it
MOVES_ON = 3

Notify = Callable[[str, ControlNotice], Awaitable[None]]
PickTarget = Callable[[frozenset[str]], Awaitable[str | None]]


async def retried(label: str, step: Callable[[], Awaitable[T]]) -> T:
    """`step()`, tried again after a pause on an error (ATTEMPTS in all)."""
    pause = FIRST_PAUSE_S
    for attempt in range(ATTEMPTS):
        try:
            return await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            if attempt == ATTEMPTS - 1:
                raise
            log.warning("%s failed; retrying in %.1f s", label, pause, exc_info=True)
            await asyncio.sleep(pause)
            pause *= 2
    raise AssertionError("unreachable")


async def _move_owner(
    store: SessionStore, sid: str, source: str, target: str, generation: int, paused_at: int | None
) -> int:
    async def step() -> int:
        moved = await store.move_owner(
            sid, source, target, WHY, expected_generation=generation, paused_at_ms=paused_at
        )
        if moved:
            return moved
        # a CAS that went through but whose reply was lost: on the target, one further on
        meta = await store.meta(sid)
        if meta.get("worker") == target and meta.get("owner_generation") == str(generation + 1):
            return generation + 1
        return 0

    return await retried(f"moving session {sid} to {target}", step)


async def _still_registered(store: SessionStore, target: str) -> bool:
    score: Any = await store.client.zscore(store.keys.workers(), target)
    return score is not None


async def hand_over(
    store: SessionStore,
    worker_id: str,
    sid: str,
    target: str,
    generation: int,
    paused_at: int,
    notify: Notify,
    pick: PickTarget,
) -> tuple[str, int] | None:
    """Move `sid` (owned by `worker_id` at `generation`, its final checkpoint written) to `target`;
    returns (the worker that has it, its owner generation), or None when the session was
    not ours to move any more (closed, or taken by another owner)."""
    source, tried = worker_id, {worker_id}
    new_generation = generation
    for _ in range(MOVES_ON + 1):
        new_generation = await _move_owner(store, sid, source, target, generation, paused_at)
        if not new_generation:
            return None
        if await _place(store, worker_id, sid, source, target, new_generation, notify):
            return target, new_generation
        # the target left the registry: it may have stopped reading before the entry came
        tried.add(target)
        following = await pick(frozenset(tried))
        if following is None:
            log.warning("session %s: %s left and no other worker can take it", sid, target)
            return target, new_generation  # the target's own check leaves it to the sweep
        log.warning(
            "session %s: %s left before it took the session; moving on to %s",
            sid,
            target,
            following,
        )
        source, target, generation = target, following, new_generation
    return target, new_generation


async def _place(
    store: SessionStore,
    worker_id: str,
    sid: str,
    source: str,
    target: str,
    generation: int,
    notify: Notify,
) -> bool:
    """The steps after the owner CAS; False when the target has left the registry since."""
    label = f"session {sid} to {target}"
    await retried(f"{label}: session sets", lambda: _swap_sets(store, sid, source, target))
    restore = RestoreRequest(sid, generation, WHY, worker_id)
    await retried(
        f"{label}: restore entry",
        lambda: store.inbox_append(target, restore.to_fields(), session_id=sid),
    )
    notice = ControlNotice.moved(generation, target)
    await retried(f"{label}: moved notice", lambda: notify(sid, notice))
    return await retried(f"{label}: is it live", lambda: _still_registered(store, target))


async def _swap_sets(store: SessionStore, sid: str, source: str, target: str) -> None:
    await store.client.srem(store.keys.worker_sessions(source), sid)
    await store.client.sadd(store.keys.worker_sessions(target), sid)
