"""Every connection's commands to the workers' inboxes, written in shared pipelines.

An audio append is a small XADD, and a pod carries many sessions each sending 50 appends a
second. One XADD per append meant one socket write and one Redis read per append, the
largest cost of the API pod in `bench/profile --load realtime`. Here the XADDs queued by
every connection while the writer's previous pipeline was in flight go out together in
one non-transactional pipeline: under load the round trips are shared, and when idle a
lone command leaves at once (no timer, no added wait).

Order is kept: a connection awaits each of its commands before sending the next, and a
pipeline's commands run in the order they were queued.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

MAX_BATCH = 512
INBOX_MAXLEN = 100_000  # entries per worker inbox, trimmed approximately


class InboxWriter:
    def __init__(self, client: Any, maxlen: int = INBOX_MAXLEN) -> None:
        self.client = client
        self.maxlen = maxlen
        self._queue: list[tuple[str, dict[str, Any], asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.pipelines = 0  # diagnostics: how many pipelines carried the commands
        self.commands = 0

    async def xadd(self, stream: str, fields: dict[str, Any]) -> None:
        """XADD through the next pipeline; raises what Redis raised for this command."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="inbox-writer")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((stream, fields, future))
        self._wake.set()
        await future

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
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

    async def _send(self, batch: list[tuple[str, dict[str, Any], asyncio.Future[None]]]) -> None:
        pipeline = self.client.pipeline(transaction=False)
        for stream, fields, _ in batch:
            pipeline.xadd(stream, fields, maxlen=self.maxlen, approximate=True)
        results = await pipeline.execute(raise_on_error=False)
        self.pipelines += 1
        self.commands += len(batch)
        for (_, _, future), result in zip(batch, results, strict=True):
            if future.done():
                continue  # its caller went away
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(None)

    @staticmethod
    def _fail(
        batch: list[tuple[str, dict[str, Any], asyncio.Future[None]]], exc: Exception
    ) -> None:
        for _, _, future in batch:
            if not future.done():
                future.set_exception(exc)
                with contextlib.suppress(Exception):
                    future.exception()  # retrieved: no "never retrieved" warning if unawaited
