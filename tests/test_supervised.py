"""SupervisedLoop: a failing loop is logged (once per run of failures) and restarted with
backoff; stop cancels it. OutageLog: a run of failures is one line, its end another."""

import asyncio
import logging

from shared.backoff import Backoff
from shared.supervised import SupervisedLoop, stop_all

FAST = Backoff(initial_s=0.001, max_s=0.01)


async def test_a_body_that_raises_is_logged_and_restarted(caplog):
    runs = 0
    third_run = asyncio.Event()

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs == 3:
            third_run.set()
            await asyncio.Event().wait()  # runs until stopped
        raise RuntimeError(f"failure {runs}")

    loop = SupervisedLoop("flaky", body, backoff=FAST)
    with caplog.at_level(logging.WARNING, logger="duplex.loops"):
        loop.start()
        async with asyncio.timeout(10):
            await third_run.wait()
    assert loop.failures == 2 and loop.running
    # two failures in a row are one run: logged once, with the first one's traceback
    failures = [r for r in caplog.records if "loop flaky failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info[1].args == ("failure 1",)
    await loop.stop()
    assert not loop.running


async def test_the_task_carries_the_loop_name():
    started = asyncio.Event()

    async def body() -> None:
        started.set()
        await asyncio.Event().wait()

    loop = SupervisedLoop("named-loop", body).start()
    await started.wait()
    assert "named-loop" in {task.get_name() for task in asyncio.all_tasks()}
    await loop.stop()
    assert "named-loop" not in {task.get_name() for task in asyncio.all_tasks()}


async def test_a_body_that_returns_ends_the_loop():
    calls = []

    async def body() -> None:
        calls.append(1)

    loop = SupervisedLoop("once", body).start()
    async with asyncio.timeout(10):
        while loop.running:
            await asyncio.sleep(0)
    assert calls == [1] and loop.failures == 0


async def test_every_runs_the_step_on_its_clock_and_survives_a_failing_step():
    steps = 0
    five = asyncio.Event()

    async def step() -> None:
        nonlocal steps
        steps += 1
        if steps == 5:
            five.set()
        if steps == 2:
            raise ConnectionError("redis went away")

    loop = SupervisedLoop.every("beat", 0.001, step, backoff=FAST).start()
    async with asyncio.timeout(10):
        await five.wait()
    assert loop.failures == 1
    await stop_all([loop, None])
    assert not loop.running


async def test_the_backoff_grows_with_failures_in_a_row():
    pauses = []

    class Recording(Backoff):
        def next_delay(self) -> float:
            super().next_delay()
            pauses.append(self.failures)
            return 0.0

    async def body() -> None:
        if len(pauses) >= 4:
            await asyncio.Event().wait()
        raise RuntimeError("again")

    loop = SupervisedLoop("streak", body, backoff=Recording(initial_s=0.1, max_s=60)).start()
    async with asyncio.timeout(10):
        while len(pauses) < 4:
            await asyncio.sleep(0)
    assert pauses == [1, 2, 3, 4]  # never reset: each run failed at once
    await loop.stop()


async def test_a_run_of_failing_steps_is_one_line_and_its_end_another(caplog):
    """Redis failing over fails every try of a heartbeat for seconds: one WARNING when it
    starts, one when it works again, with how many tries failed."""
    steps = 0
    eight = asyncio.Event()

    async def step() -> None:
        nonlocal steps
        steps += 1
        if steps == 8:
            eight.set()
        if 2 <= steps <= 6:
            raise ConnectionError("redis went away")

    with caplog.at_level(logging.WARNING, logger="duplex.loops"):
        loop = SupervisedLoop.every("beat", 0.001, step, backoff=FAST).start()
        async with asyncio.timeout(10):
            await eight.wait()
        await loop.stop()
    assert loop.failures == 5 and loop.outage.outages == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("loop beat failed: redis went away")
    # Redis being away says it all in its message: no traceback (a bug would have one)
    assert caplog.records[0].exc_info is None
    assert lines[1].startswith("loop beat works again after") and "(5 tries failed)" in lines[1]


def test_outage_log_counts_each_run_apart(caplog):
    from shared.outage_log import OutageLog

    outage = OutageLog(logging.getLogger("test.outage"), "publishing")
    with caplog.at_level(logging.WARNING, logger="test.outage"):
        outage.succeeded()  # nothing to end
        for _ in range(3):
            outage.failed(ConnectionError("gone"), traceback=False)
        assert outage.failing
        outage.succeeded()
        outage.failed(TimeoutError())
        outage.succeeded()
    lines = [r.getMessage() for r in caplog.records]
    assert outage.outages == 2 and not outage.failing
    assert lines[0] == "publishing failed: gone (retrying; logged once until it works again)"
    assert "(3 tries failed)" in lines[1]
    assert lines[2].startswith("publishing failed: TimeoutError")
    assert "(1 try failed)" in lines[3]
    assert len(lines) == 4


def test_outage_log_says_once_when_the_run_fails_another_way(caplog):
    """A run that began as Redis away and goes on as something else (a script refusing)
    says the new error once; the same errors again stay counted."""
    from shared.outage_log import OutageLog

    outage = OutageLog(logging.getLogger("test.outage"), "publishing")
    with caplog.at_level(logging.WARNING, logger="test.outage"):
        outage.failed(ConnectionError("gone"))
        outage.failed(ConnectionError("gone"))
        outage.failed(RuntimeError("the script refused"))
        outage.failed(RuntimeError("the script refused"))
        outage.succeeded(at=None)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1] == "publishing now fails with: the script refused"
    assert caplog.records[1].exc_info is not None  # not a Redis-away error: its traceback
    assert "(4 tries failed)" in lines[2] and len(lines) == 3


def test_redis_away_in_other_words_is_the_same_run(caplog):
    """Refused, then 'no master found' while the sentinels promote: the same outage."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from shared.outage_log import OutageLog

    outage = OutageLog(logging.getLogger("test.outage"), "the heartbeat")
    with caplog.at_level(logging.WARNING, logger="test.outage"):
        outage.failed(RedisConnectionError("Connection refused"))
        outage.failed(RedisConnectionError("No master found for 'duplex'"))
        outage.failed(TimeoutError())
        outage.succeeded()
    assert len(caplog.records) == 2
