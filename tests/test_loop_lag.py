"""The event-loop watchdog: it sees a blocked loop, observes its histogram, warns (at
most once a second) and stops cleanly."""

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, generate_latest

from shared.loop_lag import LAG_METRIC, LoopLagMonitor, lag_histogram

INTERVAL_S = 0.01
BLOCK_S = 0.2


async def next_sample(monitor: LoopLagMonitor) -> None:
    seen = monitor.samples
    while monitor.samples == seen:
        await asyncio.sleep(INTERVAL_S)  # polling the observable sample count


async def test_a_blocked_loop_is_measured_observed_and_logged(caplog):
    registry = CollectorRegistry()
    monitor = LoopLagMonitor("test pod", lag_histogram(registry), 0.1, INTERVAL_S)
    monitor.start()
    try:
        await next_sample(monitor)
        with caplog.at_level(logging.WARNING, logger="shared.loop_lag"):
            time.sleep(BLOCK_S)  # what a handler that never yields does to the loop
            await next_sample(monitor)
    finally:
        await monitor.stop()
    # the monitor's timer was due INTERVAL_S after the last sample at the latest, and the
    # loop could not run it for BLOCK_S: a bound by construction, not a timing guess
    assert monitor.max_lag_s >= BLOCK_S - INTERVAL_S
    first = caplog.records[0].getMessage()
    assert first.startswith("test pod: event loop blocked for ")
    text = generate_latest(registry).decode()
    assert f'{LAG_METRIC}_bucket{{le="0.1"}}' in text and f"{LAG_METRIC}_count" in text
    assert registry.get_sample_value(f"{LAG_METRIC}_count") == monitor.samples
    assert registry.get_sample_value(f"{LAG_METRIC}_sum") >= BLOCK_S - INTERVAL_S


def test_warnings_are_rate_limited_and_carry_the_worst_lag(caplog):
    monitor = LoopLagMonitor("pod", warn_after_s=0.1)
    with caplog.at_level(logging.WARNING, logger="shared.loop_lag"):
        monitor.observe(0.5, now=10.0)  # logged
        monitor.observe(0.3, now=10.5)  # within a second of the last line: held back
        monitor.observe(0.05, now=11.0)  # under the threshold: never a line
        monitor.observe(0.2, now=11.2)  # logged, with the worst held back: 0.3 s
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "blocked for 0.500 s" in lines[0] and "blocked for 0.300 s" in lines[1]
    assert (monitor.samples, monitor.max_lag_s, monitor.last_lag_s) == (4, 0.5, 0.2)


def test_a_monitor_without_a_threshold_never_logs(caplog):
    monitor = LoopLagMonitor("worker", warn_after_s=None)
    with caplog.at_level(logging.WARNING, logger="shared.loop_lag"):
        monitor.observe(5.0, now=1.0)
    assert caplog.records == [] and monitor.max_lag_s == 5.0


async def test_start_is_idempotent_and_stop_cancels_the_task():
    def named() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t.get_name() == "loop-lag-pod"]

    monitor = LoopLagMonitor("pod", interval_s=INTERVAL_S)
    monitor.start()
    monitor.start()
    tasks = named()
    assert len(tasks) == 1  # one supervised loop, however often it is started
    await next_sample(monitor)
    await monitor.stop()
    assert tasks[0].cancelled() and named() == []
    await monitor.stop()  # twice: nothing to do
