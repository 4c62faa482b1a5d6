"""A cancelled task stops: no `asyncio.wait_for` in our code, because on Python 3.11 it
swallows a cancellation that arrives as the awaited thing completes (CPython gh-86296,
fixed in 3.12). The fuzz harness hung on it in a fresh clone: its control conversation was
cancelled while an answer arrived, carried on talking, and the test waited for it forever.
`asyncio.timeout()` re-raises the cancellation, and is what we use instead."""

import ast
import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_wait_for_in_the_code_or_the_harness():
    offenders = []
    for top in ("shared", "services", "plugins", "bench", "harness"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr == "wait_for"
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "asyncio"
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


async def waiter_cancelled_as_its_event_fires(wait) -> str:
    """Cancel a task in the same loop iteration as the event it waits on is set."""
    event = asyncio.Event()

    async def waiter() -> str:
        await wait(event)
        return "cancellation swallowed"

    task = asyncio.create_task(waiter())
    while not event._waiters:  # the waiter is blocked on the event now
        await asyncio.sleep(0)
    event.set()
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def with_timeout(event: asyncio.Event) -> None:
    async with asyncio.timeout(5):
        await event.wait()


async def with_wait_for(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), 5)


async def test_timeout_passes_the_cancellation_on():
    assert await waiter_cancelled_as_its_event_fires(with_timeout) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for was rewritten in 3.12")
async def test_wait_for_swallows_it_on_this_python():
    """Why the rule exists (and a sign to drop it once 3.11 is no longer supported)."""
    assert await waiter_cancelled_as_its_event_fires(with_wait_for) == "cancellation swallowed"
