"""Every connection's commands to the workers' inboxes, written in shared pipelines.

An audio append is a small inbox entry, and a pod carries many sessions each sending 50
appends a second. One round trip per append meant one socket write and one Redis read per
append, the largest cost of the API pod in `bench/profile --load realtime`. Here the
appends queued by every connection while the writer's previous pipeline was in flight go
out together in one non-transactional pipeline: under load the round trips are shared, and
when idle a lone command leaves at once (no timer, no added wait).

Each entry goes through `inbox_append.lua`, which keeps the worker's inbox inside a byte
budget: the worker deletes what it handled, so the budget bounds the backlog a client can
leave in Redis when it writes faster than the worker reads. A refused entry raises
`InboxFull` in its caller; control messages (close) are never refused.

Order is kept: a connection awaits each of its commands before sending the next, and a
pipeline's commands run in the order they were queued.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from shared.redis.boundary import entry_bytes
from shared.redis.keys import KeySchema
from shared.redis.scripts import Scripts
from shared.supervised import SupervisedLoop

MAX_BATCH = 512
#: bytes of unhandled commands a worker's inbox may hold (a worker reads far faster than
#: real-time clients write: a backlog this large means it is stalled or flooded)
INBOX_MAX_BYTES = 64 * 1024 * 1024
REFUSED = -1  # inbox_append.lua: over the budget, nothing written

_Pending = tuple[list[str], list[Any], asyncio.Future[None]]


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
    ) -> None:
        self.client = client
        self.keys = keys or KeySchema()
        self.script = (scripts or Scripts()).inbox_append
        self.max_bytes = max_bytes
        self._queue: list[_Pending] = []
        self._wake = asyncio.Event()
        # started by the first append; a batch that fails fails its callers, not the loop
        self._loop = SupervisedLoop("inbox-writer", self._run)
        self.pipelines = 0  # diagnostics: how many pipelines carried the commands
        self.commands = 0

    async def append(
        self, worker_id: str, fields: dict[str, Any], *, budgeted: bool = True
    ) -> None:
        """Write one entry to the worker's inbox through the next pipeline. Raises
        `InboxFull` when the budget refused it, or what Redis raised for this command."""
        self._loop.start()
        keys = [self.keys.inbox(worker_id), self.keys.inbox_bytes(worker_id)]
        args: list[Any] = [self.max_bytes if budgeted else 0, entry_bytes(fields)]
        for name, value in fields.items():
            args += [name, value]
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((keys, args, future))
        self._wake.set()
        await future

    async def stop(self) -> None:
        await self._loop.stop()
        self._fail(self._queue, RedisConnectionError("the inbox writer stopped"))
        self._queue = []

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            if self._queue:
                self._wake.set()
            if not batch:
                continue
            try:
                await self._send(batch)
            except asyncio.CancelledError:
                self._fail(batch, RedisConnectionError("the inbox writer stopped"))
                raise
            except Exception as exc:  # Redis unreachable: every caller hears it
                self._fail(batch, exc)

    async def _execute(self, batch: list[_Pending]) -> list[Any]:
        pipeline = self.client.pipeline(transaction=False)
        for keys, args, _ in batch:
            # execute_command, not evalsha(): redis-py's cluster pipeline blocks the
            # evalsha method, yet routes EVALSHA by its keys (both in the worker's slot)
            pipeline.execute_command("EVALSHA", self.script.sha, len(keys), *keys, *args)
        return await pipeline.execute(raise_on_error=False)

    async def _send(self, batch: list[_Pending]) -> None:
        results = await self._execute(batch)
        self.pipelines += 1
        self.commands += len(batch)
        missing = [item for item, result in zip(batch, results, strict=True) if _lost(result)]
        self._settle([(item, r) for item, r in zip(batch, results, strict=True) if not _lost(r)])
        if missing:
            # a Redis (or a cluster node) restarted and lost its scripts: those calls did
            # not run (and the other calls of the same inbox failed with them: one node),
            # so only they are sent again, in their order; the others are settled already
            try:
                await self.script.ensure_loaded(self.client)
                retried = await self._execute(missing)
            except Exception as exc:
                self._fail(missing, exc)
                return
            self._settle(list(zip(missing, retried, strict=True)))

    @staticmethod
    def _settle(done: list[tuple[_Pending, Any]]) -> None:
        for (_, _, future), result in done:
            if future.done():
                continue  # its caller went away
            if isinstance(result, Exception):
                future.set_exception(result)
            elif int(result) == REFUSED:
                future.set_exception(InboxFull("the worker's inbox is over its budget"))
            else:
                future.set_result(None)

    @staticmethod
    def _fail(batch: list[_Pending], exc: Exception) -> None:
        for _, _, future in batch:
            if not future.done():
                future.set_exception(exc)
                with contextlib.suppress(Exception):
                    future.exception()  # retrieved: no "never retrieved" warning if unawaited
