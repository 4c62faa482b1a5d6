"""The long-lived tasks of the worker's sessions: named after their session, one input task
however many appends arrive, all of them ended by close and shutdown."""

import asyncio

from harness.sessions import appends, make_harness, send_all, sine


def tasks_of(session_id: str) -> list[str]:
    return sorted(t.get_name() for t in asyncio.all_tasks() if t.get_name().endswith(session_id))


async def test_one_input_task_per_session_however_many_appends(harness):
    session = await harness.open()
    sid = session.session_id
    expected = [f"session-input:{sid}", f"session-runner:{sid}"]
    assert tasks_of(sid) == expected
    await send_all(session, appends(sine(16000, 2.0), 16000))  # 100 appends, none applied yet
    await session.until("input_audio_buffer.speech_started")  # the first one is
    assert tasks_of(sid) == expected  # the other 99 wait in the queue, not in tasks
    await session.send({"type": "input.commit"})
    await session.until("rate_limits.updated")
    assert tasks_of(sid) == expected


async def test_close_ends_the_session_tasks():
    h = make_harness()
    try:
        session = await h.open()
        named = {t for t in asyncio.all_tasks() if t.get_name().endswith(session.session_id)}
        assert len(named) == 2
        await send_all(session, appends(sine(16000, 0.2), 16000))
        await session.close()
        await session.until("session.closed")
        assert all(task.done() for task in named)
        assert tasks_of(session.session_id) == []
        assert h.manager.table.slots_in_use == 0
    finally:
        await h.manager.shutdown()


async def test_the_reaper_is_a_named_loop_that_shutdown_stops():
    h = make_harness(reaper_interval_s=0.01)
    ticks = asyncio.Event()

    async def reap_once():
        ticks.set()
        return []

    h.manager.reap_once = reap_once
    h.manager.start()
    h.manager.start()  # idempotent: still one reaper
    reapers = [t for t in asyncio.all_tasks() if t.get_name() == "session-reaper"]
    assert len(reapers) == 1
    await ticks.wait()
    await h.manager.shutdown()
    assert reapers[0].done()
    assert [t for t in asyncio.all_tasks() if t.get_name() == "session-reaper"] == []
