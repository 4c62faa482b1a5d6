"""SupervisedLoop: a failing loop is logged and restarted with backoff; stop cancels it."""

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
    failures = [r for r in caplog.records if "loop flaky failed" in r.getMessage()]
    assert len(failures) == 2 and failures[0].exc_info[1].args == ("failure 1",)
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
