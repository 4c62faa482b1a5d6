"""Flag and Mailbox (services/api/waitables.py): asyncio's Event and Queue behaviour, with
nothing allocated while idle."""

import asyncio

import pytest

from services.api.output_queue import OutItem, OutputQueue
from services.api.waitables import Flag, Mailbox


async def test_a_flag_wakes_every_waiter_and_returns_at_once_while_set():
    flag = Flag()
    waiters = [asyncio.create_task(_wait(flag)) for _ in range(3)]
    await asyncio.sleep(0)  # the waiters reach their wait
    assert not any(w.done() for w in waiters)
    flag.set()
    assert await asyncio.gather(*waiters) == [True, True, True]
    assert await flag.wait() is True  # set: no waiting
    flag.clear()
    assert not flag.is_set()


async def _wait(flag: Flag) -> bool:
    return await flag.wait()


async def test_a_cancelled_flag_waiter_is_swept_out_and_the_idle_flag_holds_nothing():
    flag = Flag()
    assert flag._waiters is None  # idle: no waiter list at all
    cancelled = asyncio.create_task(_wait(flag))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    live = asyncio.create_task(_wait(flag))
    await asyncio.sleep(0)
    assert len(flag._waiters) == 1  # the cancelled one was swept out by the next wait
    flag.set()
    assert await live is True
    assert flag._waiters is None


async def test_a_mailbox_is_fifo_waits_for_items_and_frees_its_deque_when_empty():
    box: Mailbox[int] = Mailbox()
    assert box.empty() and box._items is None
    reader = asyncio.create_task(box.get())
    await asyncio.sleep(0)
    assert not reader.done()
    box.put_nowait(1)
    box.put_nowait(2)
    assert await reader == 1
    assert len(box) == 1 and box.qsize() == 1
    assert await box.get() == 2
    assert box.empty() and box._items is None  # drained: the deque is gone
    with pytest.raises(asyncio.QueueEmpty):
        box.get_nowait()


async def test_a_cancelled_mailbox_get_takes_nothing():
    box: Mailbox[str] = Mailbox()
    reader = asyncio.create_task(box.get())
    await asyncio.sleep(0)
    box.put_nowait("kept")
    reader.cancel()  # woken but not yet run: the item must stay queued
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert await box.get() == "kept"


async def test_two_mailbox_readers_each_get_one_item():
    box: Mailbox[int] = Mailbox()
    readers = [asyncio.create_task(box.get()) for _ in range(2)]
    await asyncio.sleep(0)
    box.put_nowait(1)
    box.put_nowait(2)
    assert sorted(await asyncio.gather(*readers)) == [1, 2]


async def test_an_idle_output_queue_holds_no_deque_and_frees_it_once_drained():
    queue = OutputQueue(max_bytes=10**6, max_events=100, reserve_bytes=10, reserve_events=1)
    assert queue._items is None and queue._ready._waiters is None
    writer = asyncio.create_task(queue.get())
    await asyncio.sleep(0)
    queue.put(OutItem(b'{"type":"a"}', "a"))
    queue.put(OutItem(b'{"type":"b"}', "b"))
    assert (await writer).wire_type == "a"
    assert (await queue.get()).wire_type == "b"
    assert queue._items is None and len(queue) == 0
    await asyncio.wait_for(queue.drained(), 1)


async def test_dropping_every_queued_audio_delta_leaves_the_queue_drained():
    queue = OutputQueue(max_bytes=10**6, max_events=100, reserve_bytes=10, reserve_events=1)
    queue.put(OutItem(b"{}", "response.output_audio.delta", "r1"))
    assert queue.drop_audio("r1") == 1
    assert queue._items is None and queue.bytes == 0
    await asyncio.wait_for(queue.drained(), 1)
