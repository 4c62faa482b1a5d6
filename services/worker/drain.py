"""`Drain`: a worker's SIGTERM, moving its sessions to other workers instead of closing them.

1. The registration says `draining` at once (the next beat is sent now): placement sends
   nothing new here; heartbeats go on, so the dead-worker sweep leaves the worker alone.
   Opens that still arrive are refused with `resource_exhausted` (the API pod tries the
   next worker); restores are taken (a move that raced the flag), and moved on like the rest.
2. Each session moves as soon as it is idle (`manager.is_idle`: no response, no turn or
   input work in flight). At `drain_timeout_s` the responses still active are cancelled
   (reason `shutdown`) and their sessions move too. A session for whose model no other
   live worker has room closes as before the drain existed (reason `shutdown`).
3. The move of session S to worker B (the first the placement ring gives, this worker
   excluded): `manager.hand_off(S)` (final checkpoint, with the uncommitted input) ->
   the publisher stores it, fenced, after S's pending events -> `move_owner(S, A, B,
   "drain")` -> S leaves A's session set for B's -> `RestoreRequest` into B's inbox ->
   `!moved <generation> <B>` on S's live channel. Inbox entries of S read while the move
   is under way are kept back, and sent on to B's inbox once the RestoreRequest is there;
   every entry of S read after that is forwarded at once, fields unchanged (B orders them by
   their (attachment, seq) marks).
4. When no session is left, the worker keeps forwarding until its inbox has been quiet for
   `LINGER_S` (an API pod that had not heard a `moved` notice yet), then returns: the
   caller deregisters and exits.

One INFO line per move gives the pause it caused: from the moment the session stopped
being served here to the moment its RestoreRequest and notice were out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from services.worker.handover import hand_over
from shared.contracts import DuplexSessionError
from shared.ids import now_ms
from shared.redis.boundary import FORWARDED_KINDS, ControlNotice, InboxMessage
from shared.redis.placement import WorkerDirectory

if TYPE_CHECKING:
    from services.worker.host import WorkerHost

log = logging.getLogger(__name__)

#: how long the inbox must have been quiet (no entry of a moved session) after the last
#: move before the worker deregisters
LINGER_S = 0.5
#: forwarding stops this long after the last move all the same (an API pod that never
#: hears the notice re-reads the session's owner when its subscription catches up)
LINGER_MAX_S = 5.0
#: how often the drain looks at its sessions (whether they are idle yet)
POLL_S = 0.02
#: how long "no worker can take this model" is believed before it is asked again
NO_TARGET_RECHECK_S = 0.5
#: how long the inbox read blocks while draining (so the linger ends soon after it may)
DRAIN_READ_BLOCK_MS = 100

Fields = Mapping[bytes, Any]


@dataclasses.dataclass
class MoveRecord:
    session_id: str
    target: str
    owner_generation: int
    pause_ms: float


class Drain:
    def __init__(
        self,
        worker: WorkerHost,
        *,
        clock: Callable[[], float] = time.monotonic,
        linger_s: float = LINGER_S,
    ) -> None:
        self.worker = worker
        self.clock = clock
        self.linger_s = linger_s
        self.directory = WorkerDirectory(
            worker.redis.client, worker.keys, worker.settings.heartbeat_ttl_s
        )
        #: sessions whose move is under way -> the entries read for them meanwhile
        self.moving: dict[str, list[Fields]] = {}
        #: sessions moved away -> their new worker
        self.moved: dict[str, str] = {}
        self.moves: list[MoveRecord] = []
        self.closed: list[str] = []
        self.forwarded = 0
        self._placed: collections.Counter[str] = collections.Counter()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: model -> (when it was asked, whether another worker has room for it)
        self._room: dict[str, tuple[float, bool]] = {}
        self._last_activity = self._last_move_at = clock()
        self._rounds = 0
        self._activity = asyncio.Event()

    # ------------------------------------------------------------ the inbox's side

    def read_round(self) -> None:
        """The consume loop finished one XREADGROUP (with entries or none)."""
        self._rounds += 1
        self._activity.set()

    async def take(self, fields: Fields) -> bool:
        """An entry read from the inbox: True when it belongs to a session moving or moved
        away (kept back, or forwarded), False when the worker handles it itself."""
        raw = fields.get(b"s")
        if raw is None:
            return False
        sid = raw.decode() if isinstance(raw, bytes) else str(raw)
        if sid in self.moving:
            self.moving[sid].append(fields)
            return True
        target = self.moved.get(sid)
        if target is None:
            return False
        await self._forward(sid, target, [fields])
        return True

    async def _forward(self, sid: str, target: str, entries: list[Fields]) -> None:
        forwarded = [fields for fields in entries if fields.get(b"k") in FORWARDED_KINDS]
        for fields in entries:
            if fields.get(b"k") not in FORWARDED_KINDS:
                kind = fields.get(b"k", b"?")
                log.info("session %s moved: a %r entry for it is not forwarded", sid, kind)
        await self.worker.store.inbox_forward(target, forwarded)
        if forwarded:
            self.forwarded += len(forwarded)
            self._last_activity = self.clock()
            log.info(
                "%d inbox entries of moved session %s forwarded to %s", len(forwarded), sid, target
            )

    # ------------------------------------------------------------ the drain

    async def run(self) -> None:
        """Move every session away, then linger; returns when the worker may deregister."""
        worker = self.worker
        worker.read_block_ms = DRAIN_READ_BLOCK_MS
        started = self.clock()
        deadline = started + worker.settings.drain_timeout_s
        log.info(
            "worker %s draining: %d sessions to move (deadline %.1f s)",
            worker.worker_id,
            len(worker.manager.session_ids()),
            worker.settings.drain_timeout_s,
        )
        await self._drain(deadline)
        log.info(
            "worker %s drained in %.2f s: %d sessions moved, %d closed, %d inbox entries forwarded",
            worker.worker_id,
            self.clock() - started,
            len(self.moves),
            len(self.closed),
            self.forwarded,
        )

    async def _drain(self, deadline: float) -> None:
        manager = self.worker.manager
        while True:
            now = self.clock()
            if now >= deadline + LINGER_MAX_S:  # moves keep failing (Redis is away)
                log.warning(
                    "drain past its deadline with %d sessions left: they close (shutdown)",
                    len(manager.session_ids()),
                )
                if self._tasks:
                    await asyncio.wait(list(self._tasks.values()), timeout=LINGER_MAX_S)
                return
            try:
                await self._start_moves(overdue=now >= deadline)
            except Exception:
                log.warning("drain: looking for workers to move to failed; retrying", exc_info=True)
            if manager.session_ids() or self._tasks:
                await self._wait(POLL_S)
                continue
            if not self.moved or self._quiet():
                return
            await self._wait(self.linger_s)

    def _quiet(self) -> bool:
        """The inbox was read at least twice since the last move (so one whole read began
        after it) and nothing came for a moved session for the linger."""
        now = self.clock()
        if now - self._last_move_at >= LINGER_MAX_S:
            return True
        return self._rounds >= 2 and now - self._last_activity >= self.linger_s

    async def _wait(self, timeout: float) -> None:
        self._activity.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._activity.wait()

    async def _start_moves(self, overdue: bool) -> None:
        manager = self.worker.manager
        for sid in manager.session_ids():
            if sid in self._tasks:
                continue
            busy = not manager.is_idle(sid) or self.worker.order.held(sid)
            if not overdue and busy:
                if await self._has_no_target(manager.model_of(sid)):
                    self._start(sid, self._close(sid))
                continue
            # from now on its entries are kept back: nothing reaches the session after the
            # idle check (a commit that came meanwhile would start a response the hand-off
            # then cancels)
            self.moving[sid] = []
            self._start(sid, self._move(sid, cancel=overdue))

    def _start(self, sid: str, work: Any) -> None:
        task = asyncio.create_task(work, name=f"drain-move:{sid}")
        self._tasks[sid] = task
        task.add_done_callback(lambda done, sid=sid: self._done(sid, done))

    def _done(self, sid: str, task: asyncio.Task[None]) -> None:
        self._tasks.pop(sid, None)
        self._activity.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("moving session %s failed", sid, exc_info=task.exception())
            self.moving.pop(sid, None)

    async def _has_no_target(self, model: str) -> bool:
        """No other live worker of the model has room (the answer is kept for
        NO_TARGET_RECHECK_S): a busy session is closed then rather than waited for."""
        asked = self._room.get(model)
        if asked is None or self.clock() - asked[0] >= NO_TARGET_RECHECK_S:
            asked = (self.clock(), await self._target(model, "") is not None)
            self._room[model] = asked
        return not asked[1]

    async def _target(
        self, model: str, sid: str, exclude: frozenset[str] = frozenset()
    ) -> str | None:
        return await self.directory.first_with_room(
            model, sid, exclude | {self.worker.worker_id}, self._placed
        )

    async def _close(self, sid: str) -> None:
        log.info("session %s: no other worker can take it; closing it (shutdown)", sid)
        await self.worker.manager.close(sid, "shutdown")
        self.worker.order.forget(sid)
        self.closed.append(sid)

    async def _give_back(self, sid: str) -> None:
        """The move did not begin: the entries kept back are handled here after all, in
        the order read (the consume loop keeps adding to them until they are all out)."""
        while self.moving.get(sid):
            entries, self.moving[sid] = self.moving[sid], []
            for fields in entries:
                try:
                    await self.worker.dispatch(InboxMessage.from_fields(fields))
                except Exception:
                    log.exception("session %s: an inbox entry kept back failed", sid)
        self.moving.pop(sid, None)

    async def _move(self, sid: str, *, cancel: bool) -> None:
        worker = self.worker
        manager = worker.manager
        try:
            target = await self._target(manager.model_of(sid), sid)
            if target is not None and cancel and not manager.is_idle(sid):
                log.info("session %s: drain deadline passed; cancelling its response", sid)
                await manager.cancel_active(sid, "shutdown")
            generation = manager.owned_sessions().get(sid)
        except BaseException:
            await self._give_back(sid)
            raise
        if target is None or generation is None:  # none can take it, or it closed meanwhile
            await self._give_back(sid)
            if target is None:
                await self._close(sid)
            return
        self._placed[target] += 1
        paused_at = now_ms()
        began = time.perf_counter()
        # commands still held for their predecessors are applied now (gaps reported): the
        # checkpoint must hold them, as it holds everything read before the move
        await worker.release_held(sid)
        try:
            checkpoint = await manager.hand_off(sid)
        except DuplexSessionError as exc:
            log.info("session %s not moved: %s", sid, exc.message)
            self._placed[target] -= 1
            self.moving.pop(sid, None)
            return
        worker.order.forget(sid)
        if not await worker.publisher.write_checkpoint(sid, checkpoint):
            log.warning("session %s: its final checkpoint was refused (fenced out)", sid)
            self._placed[target] -= 1
            self.moving.pop(sid, None)
            return
        self._forget(sid)
        handed = await hand_over(
            worker, sid, target, generation, paused_at, self._notify, self._target_excluding
        )
        if handed is None:
            log.warning(
                "session %s: not moved to %s (closed, or owned by another worker now)", sid, target
            )
            self._placed[target] -= 1
            self.moving.pop(sid, None)
            return
        if handed[0] != target:
            self._placed[target] -= 1
            self._placed[handed[0]] += 1
        target, new_generation = handed
        pause_ms = (time.perf_counter() - began) * 1000
        # what was read for it meanwhile goes first; later entries are forwarded as read
        while self.moving[sid]:
            entries, self.moving[sid] = self.moving[sid], []
            await self._forward(sid, target, entries)
        del self.moving[sid]
        self.moved[sid] = target
        self._last_activity = self._last_move_at = self.clock()
        self._rounds = 0
        self.moves.append(MoveRecord(sid, target, new_generation, pause_ms))
        log.info(
            "session %s moved to %s (owner generation %d, %d checkpoint bytes): paused %.0f ms",
            sid,
            target,
            new_generation,
            len(checkpoint),
            pause_ms,
        )

    async def _target_excluding(self, exclude: frozenset[str]) -> str | None:
        return await self._target(self.worker.manager.plugin.plugin_id, "", exclude)

    async def _notify(self, sid: str, notice: ControlNotice) -> None:
        """The notice on the session's live channel (SPUBLISH on a cluster: to the shard
        that owns the channel, where its API pods listen)."""
        await self.worker.redis.publish(self.worker.keys.live(sid), notice.to_bytes())

    def _forget(self, sid: str) -> None:
        forget = getattr(self.worker.publisher, "forget_session", None)
        if callable(forget):
            forget(sid)
