"""A watchdog of the event loop's lag: how late a timer wakes up.

Every coroutine of a process shares one thread; a handler that computes for
50 ms delays every socket of the process by 50 ms (issue 14: a streamed chat
completion froze an API pod for 16 s). The watchdog sleeps `interval_s`, then
compares when it woke with when it asked to: the difference is the time the
loop spent on other work past its turn. It keeps the last and the largest lag,
observes a Prometheus histogram (`duplex_event_loop_lag_seconds`, the same
name in every process kind) and logs a WARNING past `warn_after_s`.

It reports a stall once the stall is over (a blocked loop cannot run the
watchdog either): the figure is exact, the line comes late. At most one
WARNING a second, carrying the worst lag since the previous one, so an
overloaded process does not also flood its log.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Histogram

from shared.supervised import SupervisedLoop

log = logging.getLogger(__name__)

LAG_METRIC = "duplex_event_loop_lag_seconds"
#: from timer slop (about 1 ms) to a frozen process
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: 20 wake-ups a second: fine enough to see a 50 ms stall, cheap enough to never matter
DEFAULT_INTERVAL_S = 0.05
DEFAULT_WARN_AFTER_S = 0.1
#: the shortest time between two WARNING lines
LOG_EVERY_S = 1.0


def lag_histogram(registry: CollectorRegistry) -> Histogram:
    """The loop-lag metric, registered in `registry` (one per process kind)."""
    return Histogram(
        LAG_METRIC,
        "How late the event loop ran a timer: time spent past its turn on other work",
        buckets=LAG_BUCKETS,
        registry=registry,
    )


class LoopLagMonitor:
    """Measures the running loop's lag in a named background task (start/stop)."""

    def __init__(
        self,
        name: str,
        histogram: Histogram | None = None,
        warn_after_s: float | None = DEFAULT_WARN_AFTER_S,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self.name = name
        self.histogram = histogram
        #: None: measure and observe, never log (another monitor on the same loop logs)
        self.warn_after_s = warn_after_s
        self.interval_s = interval_s
        self.last_lag_s = 0.0
        self.max_lag_s = 0.0
        self.samples = 0
        self._loop = SupervisedLoop(f"loop-lag-{name}", self._run)
        self._unlogged_max_s = 0.0
        self._last_log = float("-inf")

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    def observe(self, lag_s: float, now: float) -> None:
        """Record one measurement (the task's; tests call it directly)."""
        lag_s = max(0.0, lag_s)
        self.samples += 1
        self.last_lag_s = lag_s
        self.max_lag_s = max(self.max_lag_s, lag_s)
        if self.histogram is not None:
            self.histogram.observe(lag_s)
        if self.warn_after_s is None or lag_s < self.warn_after_s:
            return
        self._unlogged_max_s = max(self._unlogged_max_s, lag_s)
        if now - self._last_log >= LOG_EVERY_S:
            log.warning(
                "%s: event loop blocked for %.3f s (a handler computed without yielding; "
                "warning threshold %.3f s)",
                self.name,
                self._unlogged_max_s,
                self.warn_after_s,
            )
            self._last_log = now
            self._unlogged_max_s = 0.0

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            self.observe(now - expected, now)
