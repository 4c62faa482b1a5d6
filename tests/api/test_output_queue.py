"""The per-connection send queue's overflow policy."""

import asyncio

from services.api.output_queue import OutItem, OutputQueue


def item(
    wire_type: str, size: int = 100, response_id: str | None = None, status: str = ""
) -> OutItem:
    body = b'{"type":"%s"%s}' % (
        wire_type.encode(),
        b',"status":"%s"' % status.encode() if status else b"",
    )
    return OutItem(body.ljust(size, b" "), wire_type, response_id)


async def drain(queue: OutputQueue) -> list[str]:
    out = []
    while len(queue):
        out.append((await queue.get()).wire_type)
    return out


async def test_ordinary_events_stop_at_the_limit_and_are_suppressed_after():
    queue = OutputQueue(max_bytes=1000, max_events=100, reserve_bytes=300, reserve_events=2)
    assert all(queue.put(item("response.output_audio.delta", 100, "r1")) for _ in range(10))
    assert not queue.put(item("response.output_audio.delta", 100, "r1"))
    assert queue.overflowed
    assert not queue.put(item("conversation.item.added", 10))  # suppressed once overflowed
    assert queue.put(item("error", 100))  # errors and endings use the reserve
    assert queue.put(item("response.done", 100, "r1", status="failed"))
    assert not queue.put(item("response.done", 200, "r2"))  # the reserve is bounded too
    assert queue.put(item("session.closed", 5000))  # the closure slot is never refused
    kinds = await drain(queue)
    assert kinds[-3:] == ["error", "response.done", "session.closed"]


async def test_event_count_limit():
    queue = OutputQueue(max_bytes=10**6, max_events=3, reserve_bytes=10, reserve_events=1)
    assert [queue.put(item("x", 10)) for _ in range(4)] == [True, True, True, False]


async def test_a_cancel_drops_queued_audio_of_that_response_only():
    queue = OutputQueue(max_bytes=10**6, max_events=100, reserve_bytes=10, reserve_events=1)
    for wire_type, rid in [
        ("response.output_audio.delta", "r1"),
        ("response.output_audio_transcript.delta", "r1"),
        ("response.output_audio.delta", "r2"),
        ("response.output_audio.delta", "r1"),
    ]:
        queue.put(item(wire_type, 50, rid))
    queue.put(item("response.done", 50, "r1", status="cancelled"))
    kinds = await drain(queue)
    assert kinds == [
        "response.output_audio_transcript.delta",
        "response.output_audio.delta",  # r2's
        "response.done",
    ]
    assert queue.bytes == 0


async def test_closure_comes_after_everything_queued_and_get_waits():
    queue = OutputQueue(max_bytes=10**6, max_events=100, reserve_bytes=10, reserve_events=1)
    queue.put(item("session.closed"))
    queue.put(item("a"))
    assert [(await queue.get()).wire_type for _ in range(2)] == ["a", "session.closed"]
    waiter = asyncio.create_task(queue.get())
    await asyncio.sleep(0.01)  # time itself is tested: get() waits while nothing is queued
    assert not waiter.done()
    queue.put(item("late"))
    assert (await asyncio.wait_for(waiter, 1)).wire_type == "late"


async def test_drained_returns_once_the_writer_took_everything_queued():
    queue = OutputQueue(max_bytes=10**6, max_events=100, reserve_bytes=10, reserve_events=1)
    await queue.drained()  # nothing queued: at once
    queue.put(item("a"))
    queue.put(item("session.closed"))
    drained = asyncio.create_task(queue.drained())
    await asyncio.sleep(0)
    assert not drained.done()  # two items wait for the writer
    assert (await queue.get()).wire_type == "a"
    await asyncio.sleep(0)
    assert not drained.done()  # the closure is still queued
    assert (await queue.get()).wire_type == "session.closed"
    await drained
    queue.put(item("b"))
    again = asyncio.create_task(queue.drained())
    await asyncio.sleep(0)
    assert not again.done()
    await queue.get()
    await again
