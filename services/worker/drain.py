"""`Drain`: a worker's SIGTERM, moving its sessions to other workers instead of closing them.

1. The registration says `draining` at once (the next beat is sent now): placement sends
   nothing new here; heartbeats go on, so the dead-worker sweep leaves the worker alone.
   Opens that still arrive are refused with `resource_exhausted` (the API pod tries the
   next worker); restores are taken (a move that raced the flag), and moved on like the rest.
2. Each session moves as soon as it is idle (`manager.is_idle`: no response, no turn or
   input work in flight); a model-native session at once (it is never idle, and its
   model's state moves with it, its speech included). At `drain_timeout_s` the responses
   still active are cancelled (reason `shutdown`) and their sessions move too. A session
   for whose model no other live worker has room closes as before the drain existed
   (reason `shutdown`).
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

A session's move state is in its record (`control/table.py`): the task moving (or closing)
it and the inbox messages kept back meanwhile; the record stays until they are sent on.
The drain itself keeps only what is not any session's state here: where the sessions it
moved away went (their late messages are forwarded there) and which models other workers
have room for.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from services.worker.control.manager import SessionManager
from services.worker.control.table import Phase, SessionTable
from services.worker.handover import hand_over
from services.worker.publisher import RedisEventPublisher
from shared.backoff import Backoff
from shared.contracts import DuplexSessionError
from shared.ids import now_ms
from shared.outage_log import OutageLog
from shared.redis.boundary import FORWARDED_KINDS, ControlNotice, InboxMessage
from shared.redis.placement import WorkerDirectory
from shared.redis.store import SessionStore

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

Dispatch = Callable[[InboxMessage], Awaitable[None]]
Notify = Callable[[str, ControlNotice], Awaitable[None]]


@dataclasses.dataclass
class MoveRecord:
    session_id: str
    target: str
    owner_generation: int
    pause_ms: float


class Drain:
    def __init__(
        self,
        worker_id: str,
        store: SessionStore,
        manager: SessionManager,
        publisher: RedisEventPublisher,
        *,
        drain_timeout_s: float,
        heartbeat_ttl_s: float,
        dispatch: Dispatch,
        release_held: Callable[[str], Awaitable[None]],
        notify: Notify,
        clock: Callable[[], float] = time.monotonic,
        linger_s: float = LINGER_S,
        stripes: tuple[int, ...] = (0,),
    ) -> None:
        self.worker_id = worker_id
        self.store = store
        self.manager = manager
        self.moves = manager.moves
        self.table: SessionTable = manager.table
        self.publisher = publisher
        self.drain_timeout_s = drain_timeout_s
        self.dispatch = dispatch
        self.release_held = release_held
        self.notify = notify
        self.clock = clock
        self.linger_s = linger_s
        self.directory = WorkerDirectory(store.client, store.keys, heartbeat_ttl_s)
        #: sessions moved away -> their new worker (they are not held here any more: this
        #: is where their late inbox messages go)
        self.moved: dict[str, str] = {}
        self.moves_done: list[MoveRecord] = []
        self.closed: list[str] = []
        self.forwarded = 0
        self._placed: collections.Counter[str] = collections.Counter()
        #: the move and close tasks still running (a session's own is in its record)
        self._running: set[asyncio.Task[None]] = set()
        #: model -> (when it was asked, whether another worker has room for it)
        self._room: dict[str, tuple[float, bool]] = {}
        self._last_activity = self._last_move_at = clock()
        #: the worker's inbox stripes, each read by its own loop: the linger ends once
        #: every one of them was read twice since the last move
        self.stripes = stripes
        self._rounds: collections.Counter[int] = collections.Counter()
        self._activity = asyncio.Event()
        self._lookup_outage = OutageLog(log, "drain: looking for workers to move sessions to")
        self._lookup_backoff = Backoff()

    # ------------------------------------------------------------ the inbox's side

    def read_round(self, stripe: int = 0) -> None:
        """A stripe's consume loop finished one XREADGROUP (with entries or none)."""
        self._rounds[stripe] += 1
        self._activity.set()

    async def take(self, message: InboxMessage) -> bool:
        """A message read from the inbox: True when it belongs to a session moving or moved
        away (kept back, or forwarded), False when the worker handles it itself."""
        sid = message.session_id
        record = self.table.get(sid)
        if record is not None and record.kept_back is not None:
            record.kept_back.append(message)
            return True
        target = self.moved.get(sid)
        if target is None:
            return False
        await self._forward(sid, target, [message])
        return True

    async def _forward(self, sid: str, target: str, messages: list[InboxMessage]) -> None:
        forwarded = [message for message in messages if isinstance(message, FORWARDED_KINDS)]
        for message in messages:
            if not isinstance(message, FORWARDED_KINDS):
                kind = type(message).__name__
                log.info("session %s moved: a %s for it is not forwarded", sid, kind)
        await self.store.inbox_forward(target, sid, forwarded)
        if forwarded:
            self.forwarded += len(forwarded)
            self._last_activity = self.clock()
            log.info(
                "%d inbox messages of moved session %s forwarded to %s", len(forwarded), sid, target
            )

    # ------------------------------------------------------------ the drain

    async def run(self) -> None:
        """Move every session away, then linger; returns when the worker may deregister."""
        started = self.clock()
        deadline = started + self.drain_timeout_s
        log.info(
            "worker %s draining: %d sessions to move (deadline %.1f s)",
            self.worker_id,
            len(self.table.live_ids()),
            self.drain_timeout_s,
        )
        await self._drain(deadline)
        log.info(
            "worker %s drained in %.2f s: %d sessions moved, %d closed, %d inbox entries forwarded",
            self.worker_id,
            self.clock() - started,
            len(self.moves_done),
            len(self.closed),
            self.forwarded,
        )

    async def _drain(self, deadline: float) -> None:
        while True:
            now = self.clock()
            if now >= deadline + LINGER_MAX_S:  # moves keep failing (Redis is away)
                log.warning(
                    "drain past its deadline with %d sessions left: they close (shutdown)",
                    len(self.table.live_ids()),
                )
                if self._running:
                    await asyncio.wait(list(self._running), timeout=LINGER_MAX_S)
                return
            try:
                await self._start_moves(overdue=now >= deadline)
            except Exception as exc:
                # Redis away (a failover): said once for the run, tried again after a
                # growing pause rather than every poll
                self._lookup_outage.failed(exc)
                await asyncio.sleep(self._lookup_backoff.next_delay())
                continue
            self._lookup_outage.succeeded()
            self._lookup_backoff.reset()
            if self.table.live_ids() or self._running:
                await self._wait(POLL_S)
                continue
            if not self.moved or self._quiet():
                return
            await self._wait(self.linger_s)

    def _quiet(self) -> bool:
        """Every stripe of the inbox was read at least twice since the last move (so one
        whole read of each began after it) and nothing came for a moved session for the
        linger."""
        now = self.clock()
        if now - self._last_move_at >= LINGER_MAX_S:
            return True
        read = min(self._rounds[stripe] for stripe in self.stripes)
        return read >= 2 and now - self._last_activity >= self.linger_s

    async def _wait(self, timeout: float) -> None:
        self._activity.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._activity.wait()

    async def _start_moves(self, overdue: bool) -> None:
        for record in self.table.live():
            if record.drain_task is not None:
                continue
            sid = record.session_id
            busy = not self.moves.is_idle(sid) or record.order.held
            if not overdue and busy:
                if await self._has_no_target(self.moves.model_of(sid)):
                    record.drain_task = self._start(sid, self._close(sid))
                continue
            # from now on its messages are kept back: nothing reaches the session after the
            # idle check (a commit that came meanwhile would start a response the hand-off
            # then cancels)
            record.kept_back = []
            record.drain_task = self._start(sid, self._move(sid, cancel=overdue))

    def _start(self, sid: str, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work, name=f"drain-move:{sid}")
        self._running.add(task)
        task.add_done_callback(lambda done, sid=sid: self._done(sid, done))
        return task

    def _done(self, sid: str, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._activity.set()
        record = self.table.get(sid)
        if record is not None and record.drain_task is task:
            record.drain_task = None
        failed = task.cancelled() or task.exception() is not None
        if not failed:
            return
        if not task.cancelled():
            log.error("moving session %s failed", sid, exc_info=task.exception())
        if record is None or record.kept_back is None:
            return
        if record.phase is Phase.LIVE:
            # the move never took the session: what was kept back is handled here after all
            give_back = asyncio.create_task(self._give_back(sid), name=f"drain-give-back:{sid}")
            self._running.add(give_back)
            give_back.add_done_callback(self._running.discard)
        else:
            log.warning(
                "session %s: %d inbox messages kept back for its move are dropped",
                sid,
                len(record.kept_back),
            )
            self._let_go(sid)

    def _let_go(self, sid: str) -> None:
        """The session's messages are not kept back any more: its record may go."""
        record = self.table.get(sid)
        if record is not None:
            record.kept_back = None
            self.table.settle(record)

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
            model, sid, exclude | {self.worker_id}, self._placed
        )

    async def _close(self, sid: str) -> None:
        log.info("session %s: no other worker can take it; closing it (shutdown)", sid)
        await self.manager.close(sid, "shutdown")
        self.closed.append(sid)

    async def _give_back(self, sid: str) -> None:
        """The move did not begin: the messages kept back are dispatched here after all, as
        they were decoded, in the order read (the consume loop keeps adding to them until
        they are all out)."""
        record = self.table.get(sid)
        while record is not None and record.kept_back:
            kept, record.kept_back = record.kept_back, []
            for message in kept:
                try:
                    await self.dispatch(message)
                except Exception:
                    log.exception("session %s: an inbox message kept back failed", sid)
        self._let_go(sid)

    async def _move(self, sid: str, *, cancel: bool) -> None:
        moves = self.moves
        try:
            target = await self._target(moves.model_of(sid), sid)
            if target is not None and cancel and not moves.is_idle(sid):
                log.info("session %s: drain deadline passed; cancelling its response", sid)
                await moves.cancel_active(sid, "shutdown")
            generation = self.table.owner_generation(sid)
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
        await self.release_held(sid)
        try:
            checkpoint = await moves.hand_off(sid)
        except DuplexSessionError as exc:
            log.info("session %s not moved: %s", sid, exc.message)
            self._placed[target] -= 1
            self._let_go(sid)
            return
        if not await self.publisher.write_checkpoint(sid, checkpoint):
            log.warning("session %s: its final checkpoint was refused (fenced out)", sid)
            self._placed[target] -= 1
            self._let_go(sid)
            return
        handed = await hand_over(
            self.store,
            self.worker_id,
            sid,
            target,
            generation,
            paused_at,
            self.notify,
            self._target_excluding,
        )
        if handed is None:
            log.warning(
                "session %s: not moved to %s (closed, or owned by another worker now)", sid, target
            )
            self._placed[target] -= 1
            self._let_go(sid)
            return
        if handed[0] != target:
            self._placed[target] -= 1
            self._placed[handed[0]] += 1
        target, new_generation = handed
        pause_ms = (time.perf_counter() - began) * 1000
        # what was read for it meanwhile goes first; later messages are forwarded as read
        record = self.table.get(sid)
        while record is not None and record.kept_back:
            entries, record.kept_back = record.kept_back, []
            await self._forward(sid, target, entries)
        self.moved[sid] = target
        self._let_go(sid)
        self._last_activity = self._last_move_at = self.clock()
        self._rounds.clear()
        self.moves_done.append(MoveRecord(sid, target, new_generation, pause_ms))
        log.info(
            "session %s moved to %s (owner generation %d, %d checkpoint bytes): paused %.0f ms",
            sid,
            target,
            new_generation,
            len(checkpoint),
            pause_ms,
        )

    async def _target_excluding(self, exclude: frozenset[str]) -> str | None:
        return await self._target(self.moves.builder.plugin.plugin_id, "", exclude)
