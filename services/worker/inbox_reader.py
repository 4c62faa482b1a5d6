"""`InboxReader`: the worker's inbox consumer and its batched acknowledgements.

One consumer task reads one of the worker's inbox streams with XREADGROUP BLOCK (a
worker has one per Redis Cluster master, its stripes: shared/redis/inbox_stripes.py, and a
reader each; one session's messages are all in one stripe). An entry holds one
or more typed messages (`shared.redis.inbox_codec`: an API pod's round, many sessions'
commands in the order they were queued), decoded once; each message is dispatched in that
order (or, while the worker drains, taken by the drain when its session is moving or moved),
so every session gets its commands in order, across entries too. Commands carry (attachment
generation, seq): a redelivered one is dropped by the worker's `CommandOrder`.

Redelivery: after a restart the consumer first reads its own pending entries (from "0"),
then new ones (">"). The read position moves past an entry *before* its messages are
dispatched, so a consume loop restarted by its supervisor never dispatches an entry twice
(an open, a close or a chat is not deduplicated by seq); a new process re-reads what the old
one left unacknowledged, and the marks drop the commands its checkpoint already holds. An
entry that does not decode (no API pod wrote it) is refused whole, logged, and acknowledged.

Acknowledgements leave in batches, at most every `ACK_INTERVAL_S`, off the read path: one
`inbox_ack.lua` call (XACK, XDEL, DECRBY) for every entry handled meanwhile. When the inbox
goes quiet (a read that found nothing) the worker asks once more, with no entry, that the
byte counter be set to 0 if the inbox is empty. An ack that is late or lost only leaves an
entry pending, which a restarted process reads again (and its marks drop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis import exceptions as redis_errors

from shared.backoff import Backoff
from shared.outage_log import OutageLog
from shared.redis.boundary import InboxMessage, decode_entry, entry_bytes
from shared.redis.keys import INBOX_GROUP
from shared.redis.store import SessionStore

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000
READ_COUNT = 256
#: handled entries are acknowledged (and deleted) at most this often: one call for all
ACK_INTERVAL_S = 0.05

Dispatch = Callable[[InboxMessage], Awaitable[None]]


class InboxReader:
    def __init__(
        self,
        redis: Any,
        store: SessionStore,
        worker_id: str,
        inbox: str,
        dispatch: Dispatch,
        drain: Callable[[], Any],
        *,
        stripe: int = 0,
        ack_interval_s: float = ACK_INTERVAL_S,
    ) -> None:
        self.redis = redis  # a RedisHandle
        self.store = store
        self.worker_id = worker_id
        self.inbox = inbox
        #: which of the worker's inbox stripes this reader reads (shared/redis/inbox_stripes.py)
        self.stripe = stripe
        self.dispatch = dispatch
        self.ack_interval_s = ack_interval_s
        self.block_ms = READ_BLOCK_MS
        of = f" (stripe {stripe})" if stripe else ""
        self._read_outage = OutageLog(log, f"reading the inbox{of}")
        self._ack_outage = OutageLog(log, f"acknowledging inbox entries{of}")
        #: the worker's `Drain` while it drains (it forwards moved sessions' messages)
        self.drain = drain
        # where the next XREADGROUP starts: first our own pending entries (a restart), then
        # new ones; kept here so a restarted consume loop does not dispatch handled ones again
        self.read_from = "0"
        # inbox entries handled, not yet acked and deleted: (entry id, size in bytes)
        self.unacked: list[tuple[bytes, int]] = []
        self._ack_wake = asyncio.Event()
        #: its reads' and acks' client (`RedisHandle.reader_client`: on a cluster one of its
        #: own, so a stripe whose master is lost disturbs no other), made at the first read
        self._client: Any = None
        self._store: SessionStore | None = None
        self._quiet = True  # no entry acked since the inbox was last found empty

    # ------------------------------------------------------------ reading

    async def consume(self) -> None:
        """Read and dispatch for ever. Redis errors are retried here (NOGROUP: the group is
        made again; others after a backoff); what escapes restarts it under its supervisor,
        from `read_from`, so entries already dispatched are not dispatched again."""
        reader = self._own_client()
        backoff = Backoff()
        while True:
            try:
                reply = await reader.xreadgroup(
                    INBOX_GROUP,
                    self.worker_id,
                    {self.inbox: self.read_from},
                    count=READ_COUNT,
                    block=self.block_ms,
                )
            except asyncio.CancelledError:
                raise
            except redis_errors.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    # the group is gone (Redis restarted empty): make it again and go on
                    with contextlib.suppress(Exception):
                        await reader.xgroup_create(
                            self.inbox, INBOX_GROUP, id="0", mkstream=True
                        )
                else:
                    self._read_outage.failed(exc)
                    await asyncio.sleep(backoff.next_delay())
                continue
            except Exception as exc:
                # connection lost: redis-py reconnects on the next call; back off meanwhile
                # (logged once a run: a failover fails every read for seconds)
                self._read_outage.failed(exc)
                await asyncio.sleep(backoff.next_delay())
                continue
            backoff.reset()
            self._read_outage.succeeded()
            entries = reply[0][1] if reply else []
            if not entries:
                self._read_round()
                if self.read_from != ">":  # past our pending entries: new ones
                    self.read_from = ">"
                elif not self._quiet and not self.unacked:
                    self._quiet = True
                    self._ack_wake.set()  # the inbox went quiet: heal its counter once
                continue
            for entry_id, fields in entries:
                if self.read_from != ">":
                    # reading our own pending entries (a restart): go on past this one, or
                    # the next read returns it again until the ack lands, and an open,
                    # close or chat (not deduplicated by seq) would run twice
                    self.read_from = entry_id
                await self._handle(entry_id, fields)
                # counted as handled at once: a loop cancelled mid-batch (a stop) still
                # acknowledges what it dispatched, so a restart does not run it again
                self.unacked.append((entry_id, entry_bytes(fields)))
            self._quiet = False
            self._ack_wake.set()
            # counted once what it read is dispatched (forwarded, for a moved session): a
            # drain that ends on its count never leaves a forward half-way
            self._read_round()

    def _read_round(self) -> None:
        """Tell a drain this stripe finished a read."""
        if (drain := self.drain()) is not None:
            drain.read_round(self.stripe)

    def _own_client(self) -> Any:
        if self._client is None:
            self._client = self.redis.reader_client()
            self._store = SessionStore(self._client, self.store.keys, self.store.scripts)
        return self._client

    async def _handle(self, entry_id: Any, fields: Any) -> None:
        try:
            messages = decode_entry(fields)
        except Exception:
            log.exception("inbox entry %r does not decode: refused", entry_id)
            return
        for message in messages:
            try:
                drain = self.drain()
                # the drain keeps back or forwards a moving or moved session's messages
                if drain is not None and await drain.take(message):
                    continue
                await self.dispatch(message)
            except Exception:
                log.exception("inbox entry %r (%s) failed", entry_id, type(message).__name__)

    # ------------------------------------------------------------ acknowledging

    async def ack_loop(self) -> None:
        """Acknowledge and delete handled entries off the read path, in batches: awaiting
        that before the next XREADGROUP put a Redis round trip in front of every command,
        and one call per read was a third of the inbox's Redis commands."""
        backoff = Backoff()
        loop = asyncio.get_running_loop()
        last = 0.0
        while True:
            await self._ack_wake.wait()
            wait = last + self.ack_interval_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)  # more entries join this batch meanwhile
            self._ack_wake.clear()
            last = loop.time()
            try:
                await self.ack_pending(check_empty=self._quiet)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._ack_outage.failed(exc)
                await asyncio.sleep(backoff.next_delay())
                self._ack_wake.set()
                continue
            backoff.reset()
            self._ack_outage.succeeded()

    async def ack_pending(self, *, check_empty: bool = False) -> None:
        handled, self.unacked = self.unacked, []
        if not handled and not check_empty:
            return
        try:
            store = self._store or self.store  # before the first read: the process's
            await store.inbox_ack(
                self.worker_id, handled, check_empty=check_empty, stripe=self.stripe
            )
        except BaseException:
            # all of them again: a batch that did go through deletes nothing twice
            self.unacked = handled + self.unacked
            raise
