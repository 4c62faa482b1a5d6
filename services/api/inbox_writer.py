"""Every connection's commands to the workers' inboxes, in rounds: one entry per inbox.

A pod carries many sessions each sending 50 appends a second. One inbox entry (one
`inbox_append.lua` call, a GET, an XADD and an INCRBY in Redis) and one worker read per
append were most of the Redis commands of a session. Here each round of the writer takes
what every connection queued and gives each worker's inbox **one** entry: the round's
messages for it, in queue order (`services/api/inbox_round.py`), one EVALSHA (one INCRBY,
one XADD) each, all in one non-transactional pipeline. On a Redis Cluster a worker's inbox
is a stream per master (its stripes: shared/redis/inbox_stripes.py), each session's
messages in the stripe of its own master; there each entry is a call of its own, so a
master that is away fails only its stripes' entries.

When a round leaves:
- a message that is not an append (a commit, a heartbeat, an update, a close, an open, a
  chat...) sends the round at once, with every append queued ahead of it;
- appends alone wait at most `linger_s` (`DUPLEX_APPEND_LINGER_MS`, 10 ms by default), so
  that many sessions' appends share an entry; 0 sends them at once (the next round leaves
  as soon as the previous one is back, as before entries held several messages);
- a round does not leave while the previous one is in flight: what is queued meanwhile
  goes in the next.

Each entry goes through `inbox_append.lua`, which keeps the worker's inbox inside a byte
budget: the worker deletes what it handled, so the budget bounds the backlog a client can
leave in Redis when it writes faster than the worker reads. A refused entry raises
`InboxFull` in each of its budgeted callers; its unbudgeted messages (closes, heartbeats,
cancels: never refused) are sent again at once in an entry of their own, their seqs handed
out again (`CommandSeq`).

Order is kept: rounds leave one after another, a round's entries hold its items in queue
order, and one attachment's commands of a round are all in one entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError

from services.api.inbox_round import CommandSeq, Entry, Queued, items_of, take_round
from shared.outage_log import OutageLog
from shared.redis.boundary import InboxMessage
from shared.redis.inbox_stripes import StripeDirectory
from shared.redis.keys import KeySchema
from shared.redis.scripts import Scripts
from shared.supervised import SupervisedLoop

log = logging.getLogger(__name__)

__all__ = ["INBOX_MAX_BYTES", "CommandSeq", "InboxFull", "InboxWriter"]

#: bytes of unhandled commands a worker's inbox may hold (a worker reads far faster than
#: real-time clients write: a backlog this large means it is stalled or flooded)
INBOX_MAX_BYTES = 64 * 1024 * 1024
REFUSED = -1  # inbox_append.lua: over the budget, nothing written
#: an inbox that failed and was not tried again for this long leaves the outage's run
FAILING_FOR_S = 30.0
#: how long an append may wait for others to share its entry (ApiSettings.append_linger_ms)
DEFAULT_LINGER_S = 0.010


def _lost(result: Any) -> bool:
    return isinstance(result, NoScriptError)


class InboxFull(Exception):
    """The worker's inbox is over its byte budget: the command was not written."""


class InboxWriter:
    def __init__(
        self,
        client: Any,
        keys: KeySchema | None = None,
        scripts: Scripts | None = None,
        *,
        max_bytes: int = INBOX_MAX_BYTES,
        linger_s: float = DEFAULT_LINGER_S,
        stripes: StripeDirectory | None = None,
    ) -> None:
        self.client = client
        self.keys = keys or KeySchema()
        self.script = (scripts or Scripts()).inbox_append
        #: which stripe of a worker's inbox each session's messages go to
        self.stripes = stripes or StripeDirectory(client, self.keys)
        #: on a cluster each entry is its own call, so a master failing over fails only the
        #: entries of its stripes (one pipeline fails whole when one of its nodes is away)
        self.cluster = isinstance(client, RedisCluster)
        self.max_bytes = max_bytes
        self.linger_s = linger_s
        self._queue: list[Queued] = []
        self._wake = asyncio.Event()  # something is queued
        self._urgent = asyncio.Event()  # something that must not linger is queued
        self._oldest = 0.0  # when the oldest lingering item was queued (monotonic)
        # started by the first item; a round that fails fails its callers, not the loop
        self._loop = SupervisedLoop("inbox-writer", self._run)
        self.pipelines = 0  # diagnostics: how many pipelines carried the entries
        #: the pod's one log of clients' commands not written (Redis away): once a run,
        #: with how long and how many; each client hears its own refusal as an event
        self.outage = OutageLog(log, "writing clients' commands to the workers' inboxes")
        #: inboxes (worker, stripe) whose last entry failed -> when: the outage's run
        self._failing: dict[tuple[str, int], float] = {}
        self.entries = 0  # how many entries they wrote
        self.commands = 0  # how many queued items those entries carried

    # ------------------------------------------------------------ the callers' side

    def send(
        self,
        worker_id: str,
        message: InboxMessage,
        *,
        budgeted: bool = True,
        seqs: CommandSeq | None = None,
        lingers: bool = False,
    ) -> asyncio.Future[None]:
        """Queue a message for the worker's next entry; the future settles once it is
        written (`InboxFull` when the budget refused it, or what Redis raised). With
        `seqs`, the message's seq is handed out when its entry is built. `lingers`: it may
        wait up to the linger for other messages to share its entry (appends)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._enqueue(Queued(worker_id, budgeted, future, message, seqs, lingers=lingers))
        return future

    def _enqueue(self, item: Queued) -> None:
        self._route(item)
        self._loop.start()
        if not self._queue:
            self._oldest = time.monotonic()
        self._queue.append(item)
        if not item.lingers or self.linger_s <= 0:
            self._urgent.set()
        self._wake.set()

    async def stop(self) -> None:
        await self._loop.stop()
        self._fail(self._queue, RedisConnectionError("the inbox writer stopped"))
        self._queue = []

    # ------------------------------------------------------------ stripes

    def _route(self, item: Queued) -> None:
        """The item's stripe, when its worker's stripes are known here."""
        stripes = self.stripes.known(item.worker_id)
        if stripes is not None:
            item.stripe = stripes.for_session(self.keys, item.message.session_id)

    async def _learn_stripes(self) -> None:
        """Read the stripes of the workers queued items go to that this pod has not met
        yet (one GET each, once: shared/redis/inbox_stripes.py), and route those items. A
        worker whose stripes cannot be read fails its items as a write would (Redis away)."""
        for worker in dict.fromkeys(i.worker_id for i in self._queue if i.stripe is None):
            try:
                stripes = await self.stripes.of(worker)
            except Exception as exc:
                # one run of the log with the inboxes' failures (stripe -1: its lookup)
                self._failing[(worker, -1)] = time.monotonic()
                self.outage.failed(exc, traceback=False)
                failed = [i for i in self._queue if i.worker_id == worker and i.stripe is None]
                self._queue = [i for i in self._queue if i not in failed]
                self._fail(failed, exc)
                continue
            self._failing.pop((worker, -1), None)
            # items queued meanwhile too (the directory may not keep a worker that has not
            # announced: routed with what it said now)
            for item in self._queue:
                if item.stripe is None and item.worker_id == worker:
                    item.stripe = stripes.for_session(self.keys, item.message.session_id)
        for item in self._queue:
            if item.stripe is None:
                self._route(item)

    # ------------------------------------------------------------ rounds

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if not self._queue:
                self._wake.clear()
                continue
            if not self._urgent.is_set():
                # appends only: they wait for company until the oldest has lingered enough
                wait = self._oldest + self.linger_s - time.monotonic()
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):
                            await self._urgent.wait()
            if any(item.stripe is None for item in self._queue):
                await self._learn_stripes()
                if not self._queue:
                    continue
            entries, self._queue = take_round(self._queue)
            # what a cut round left (its item cap, one attachment's commands kept together)
            # has lingered since it was queued: it goes in the next round without a new wait
            self._oldest = self._queue[0].queued_at if self._queue else time.monotonic()
            if not self._queue:
                self._wake.clear()
                self._urgent.clear()
            elif not any(not item.lingers for item in self._queue):
                self._urgent.clear()
            try:
                await self._send(entries)
            except asyncio.CancelledError:
                self._fail(items_of(entries), RedisConnectionError("the inbox writer stopped"))
                raise
            except Exception as exc:  # Redis unreachable: every caller hears it
                self.outage.failed(exc, traceback=False)
                self._fail(items_of(entries), exc)

    def _keys(self, entry: Entry) -> list[str]:
        return [
            self.keys.inbox(entry.worker_id, entry.stripe),
            self.keys.inbox_bytes(entry.worker_id, entry.stripe),
        ]

    async def _execute(self, entries: list[Entry]) -> list[Any]:
        if self.cluster:
            # one call per entry, each settling on its own: a master away fails its own
            # stripes' entries, and the sessions on the other masters are written
            return await asyncio.gather(
                *(self._call(entry) for entry in entries), return_exceptions=True
            )
        pipeline = self.client.pipeline(transaction=False)
        for entry in entries:
            keys = self._keys(entry)
            args = entry.args(self.max_bytes)
            pipeline.execute_command("EVALSHA", self.script.sha, len(keys), *keys, *args)
        self.pipelines += 1
        try:
            return await pipeline.execute(raise_on_error=False)
        except RedisError:
            raise
        except Exception as exc:
            # the client library itself failed while Redis was failing over (redis-py
            # 5.3.1's cluster pipeline raises AttributeError when another command's failure
            # closed its nodes meanwhile): for the callers, their commands were not written
            # (retryable), never a bug of the socket that sent them
            raise RedisConnectionError(f"the Redis client failed: {exc!r}") from exc

    async def _call(self, entry: Entry) -> Any:
        """One entry's EVALSHA on a cluster (NOSCRIPT comes back as the reply, as in a
        pipeline: `_run_entries` loads the script and sends the call again)."""
        keys = self._keys(entry)
        try:
            return await self.client.execute_command(
                "EVALSHA", self.script.sha, len(keys), *keys, *entry.args(self.max_bytes)
            )
        except RedisError:
            raise
        except Exception as exc:  # the client library failing mid-failover (see _execute)
            raise RedisConnectionError(f"the Redis client failed: {exc!r}") from exc

    async def _send(self, entries: list[Entry]) -> None:
        results = await self._run_entries(entries)
        refused = [entry for entry, result in results if _refused(result)]
        again: list[Entry] = []
        for entry in refused:
            entry.give_back_seqs()  # nothing was written: the seqs are handed out again
            self._fail([i for i in entry.items if i.budgeted], InboxFull(_FULL))
            if (passing := entry.unbudgeted()) is not None:
                again.append(passing)
        self._settle([(entry, result) for entry, result in results if not _refused(result)])
        if again:  # what never waits for a full inbox goes now, in an entry of its own
            self._settle(await self._run_entries(again))

    async def _run_entries(self, entries: list[Entry]) -> list[tuple[Entry, Any]]:
        results = await self._execute(entries)
        done = list(zip(entries, results, strict=True))
        missing = [entry for entry, result in done if _lost(result)]
        if missing:
            # a Redis (or a cluster node) restarted and lost its scripts: those calls did
            # not run (and the other calls of the same inbox failed with them: one node),
            # so only they are sent again, in their order
            try:
                await self.script.ensure_loaded(self.client)
                retried = dict(zip(map(id, missing), await self._execute(missing), strict=True))
            except Exception as exc:
                retried = {id(entry): exc for entry in missing}
            done = [(e, retried[id(e)] if _lost(r) else r) for e, r in done]
        return done

    def _settle(self, done: list[tuple[Entry, Any]]) -> None:
        failures = [result for _, result in done if isinstance(result, Exception)]
        # one run of the log for the pod: it goes on while any inbox (a worker's stripe)
        # fails, and ends once every one that failed was written again. On a cluster a
        # round may reach one master and not another (and a round's verdict alone would say
        # "failed" and "works again" every round); an inbox no entry tried again for
        # FAILING_FOR_S is let go (its sessions went elsewhere, or stopped)
        now = time.monotonic()
        for entry, result in done:
            inbox = (entry.worker_id, entry.stripe)
            if isinstance(result, Exception):
                self._failing[inbox] = now
            else:
                self._failing.pop(inbox, None)
        for inbox, since in list(self._failing.items()):
            if now - since > FAILING_FOR_S:
                del self._failing[inbox]
        if failures:
            self.outage.failed(failures[0], traceback=False)
        elif done and not self._failing:
            self.outage.succeeded()
        for entry, result in done:
            if isinstance(result, Exception):
                self._fail(entry.items, result)
                continue
            self.entries += 1
            self.commands += len(entry.items)
            for item in entry.items:
                if not item.future.done():  # else its caller went away
                    item.future.set_result(None)

    @staticmethod
    def _fail(items: list[Queued], exc: Exception) -> None:
        for item in items:
            if not item.future.done():
                item.future.set_exception(exc)
                with contextlib.suppress(Exception):
                    item.future.exception()  # retrieved: no "never retrieved" warning


_FULL = "the worker's inbox is over its budget"


def _refused(result: Any) -> bool:
    return not isinstance(result, Exception) and int(result) == REFUSED
