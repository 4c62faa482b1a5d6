"""Supervised background loops: every long-lived task of a process runs under one of these.

A loop is named (the name is its asyncio task's name, so a task dump reads), its failure
is logged with the traceback once per run of failures (`OutageLog`: Redis failing over
fails every try for seconds; the rest of the run is counted, and the loop's recovery logged
in one line) and the loop is restarted after a jittered, growing pause (`Backoff`), and
`stop()` cancels it and waits until it has ended. A body that returns
ends the loop; one that raises is restarted, except for `CancelledError`. A loop that ran
for longer than the longest pause before it failed counts as having worked: its next
failure starts the backoff again from the shortest pause.

Two shapes of body fit:
- a coroutine that runs for ever (`SupervisedLoop("janitor", worker.async_run)`);
- a step repeated on a clock (`SupervisedLoop.every("api-heartbeat", 2.0, pod.beat)`): a
  step that fails is logged, and the next one comes after the backoff pause and then the
  interval (the restarted loop starts with its sleep).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from shared.backoff import Backoff
from shared.outage_log import OutageLog

log = logging.getLogger("duplex.loops")

Body = Callable[[], Awaitable[None]]


class SupervisedLoop:
    def __init__(self, name: str, body: Body, *, backoff: Backoff | None = None) -> None:
        self.name = name
        self._body = body
        self._backoff = backoff or Backoff(initial_s=0.1, max_s=2.0)
        self._task: asyncio.Task[None] | None = None
        self.failures = 0  # every failure since start, for tests and /metrics
        self.outage = OutageLog(log, f"loop {name}")

    @classmethod
    def every(
        cls, name: str, interval_s: float, step: Body, *, backoff: Backoff | None = None
    ) -> SupervisedLoop:
        """A loop that sleeps `interval_s`, then runs `step`, for ever. A step that works
        ends a run of failures (logged then, with how long it lasted)."""
        loop = cls(name, step, backoff=backoff)

        async def repeat() -> None:
            while True:
                await asyncio.sleep(interval_s)
                await step()
                loop.outage.succeeded()

        loop._body = repeat
        return loop

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> SupervisedLoop:
        if not self.running:
            self._task = asyncio.create_task(self._supervise(), name=self.name)
        return self

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _supervise(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self._body()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                if time.monotonic() - started > self._backoff.max_s:
                    self._backoff.reset()  # it had been working: a new failure, not a streak
                    self.outage.succeeded(at=started)  # it worked from its restart on
                self.outage.failed(exc)
                await asyncio.sleep(self._backoff.next_delay())


async def stop_all(loops: Iterable[SupervisedLoop | None]) -> None:
    """Cancel every loop and wait for all of them (in parallel: one slow stop does not hold
    the others back)."""
    await asyncio.gather(*(loop.stop() for loop in loops if loop is not None))
