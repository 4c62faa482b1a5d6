"""SIGTERM drains a worker (`WorkerProcess.stop`, services/worker/drain.py): its sessions move
to another worker from their final checkpoint, what reaches the old inbox is forwarded, and
the client's commands are applied in order. Two in-process workers on a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.drain import Drain
from shared.redis.boundary import MOVED_KIND, OpenRequest
from shared.redis.placement import WorkerDirectory
from tests.worker.test_process_fleet import Fleet, note, until

SID = "duplex-00000000000000000000000000d2a1"
OTHER = "duplex-00000000000000000000000000d2a2"


@pytest.fixture
async def fleet(redis_server):
    made = Fleet(redis_server.url)
    yield made
    await made.close()


async def moved_to_b(fleet: Fleet):
    """A session with one item on w-a, drained to w-b; returns its live channel."""
    a = await fleet.worker("w-a")
    b = await fleet.worker("w-b")
    live = await fleet.open("w-a", SID)
    await fleet.command("w-a", SID, 1, 1, note("item_1"))
    await live.item_done("item_1")
    await fleet.stop("w-a")
    await until(lambda: asyncio.sleep(0, SID in b.manager.table.live_ids()))
    return a, b, live


def held(worker, sid: str) -> int:
    """Commands of the session held for a gap on `worker` (its record's command order)."""
    record = worker.table.get(sid)
    return record.order.held if record is not None else 0


def kept_back(worker, sid: str) -> list | None:
    """The inbox messages a drain keeps back while it moves the session (None: not moving)."""
    record = worker.table.get(sid)
    return record.kept_back if record is not None else None


async def test_a_drain_moves_an_idle_session_and_the_next_commands_answer_there(fleet):
    a, b, live = await moved_to_b(fleet)
    notice = await live.notice()
    assert (notice.kind, notice.owner_generation, notice.worker_id) == (MOVED_KIND, 2, "w-b")
    meta = await fleet.meta(SID)
    assert (meta["worker"], meta["owner_generation"], meta["moved_why"]) == ("w-b", "2", "drain")
    assert int(meta["restored_at"]) >= int(meta["paused_at"])
    assert await fleet.client.sismember(fleet.keys.worker_sessions("w-b"), SID)
    assert [m.session_id for m in a.drain.moves_done] == [SID] and a.drain.closed == []
    # the old worker is gone from the registry, and its keys with it
    assert await fleet.client.zscore(fleet.keys.workers(), "w-a") is None
    assert await fleet.client.exists(fleet.keys.worker("w-a"), fleet.keys.inbox("w-a")) == 0
    # the conversation goes on on w-b: the item made on w-a is there
    await fleet.command(
        "w-b", SID, 1, 2, {"type": "conversation.item.retrieve", "item_id": "item_1"}
    )
    retrieved = await live.of_type("conversation.item.retrieved")
    assert retrieved["item"]["content"][0]["text"] == "text of item_1"
    await fleet.command("w-b", SID, 1, 3, note("item_3"))
    await live.item_done("item_3")
    seqs = live.seqs()
    assert seqs == list(range(1, len(seqs) + 1))  # contiguous across the move
    assert not any(e["type"] in ("error", "session.closed") for e in live.events)
    # no other worker left: the last one's drain closes the session as before (shutdown)
    await fleet.stop("w-b")
    closed = await live.of_type("session.closed")
    assert closed["reason"] == "shutdown"
    assert b.drain.closed == [SID]


async def test_entries_written_to_the_old_inbox_are_forwarded_and_applied_in_order(fleet):
    a = await fleet.worker("w-a")
    b = await fleet.worker("w-b")
    live = await fleet.open("w-a", SID)
    await fleet.command("w-a", SID, 1, 1, note("item_1"))
    await live.item_done("item_1")
    # a response in flight, as the drain sees it: the session is not idle until released
    released = asyncio.Event()
    real_is_idle = a.manager.moves.is_idle
    a.manager.moves.is_idle = lambda sid: released.is_set() and real_is_idle(sid)
    stopping = asyncio.create_task(fleet.stop("w-a"))

    async def draining() -> bool:
        return (await fleet.client.hget(fleet.keys.worker("w-a"), "draining")) == b"1"

    # the registration says draining at once (the beats go on) and placement skips it
    await until(draining)
    directory = WorkerDirectory(fleet.client, fleet.keys, heartbeat_ttl_s=5)
    assert [w.worker_id for w in await directory.candidates("echo", SID)] == ["w-b"]
    # an open that reaches the draining worker is refused: the API pod tries the next one
    other = await fleet.live(OTHER)
    await fleet.store.open(OTHER, "w-a", "echo", "", "{}")
    await fleet.store.inbox_append("w-a", OpenRequest(OTHER, {}).to_fields())
    refused = await other.of_type("error")
    assert refused["error"]["code"] == "resource_exhausted"
    assert SID in a.manager.table.live_ids() and not stopping.done()

    released.set()
    notice = await live.notice()
    assert notice.worker_id == "w-b"
    # an API pod that heard the notice writes seq 4 to w-b; one that had not yet wrote
    # seqs 2 and 3 to w-a: w-a forwards them, and w-b holds 4 until they are there
    await fleet.command("w-b", SID, 1, 4, note("item_4"))
    await until(lambda: asyncio.sleep(0, held(b, SID) == 1))
    for seq in (2, 3):
        await fleet.command("w-a", SID, 1, seq, note(f"item_{seq}"))
    await live.item_done("item_4")
    await asyncio.wait_for(stopping, 15)
    assert a.drain.forwarded == 2
    created = live.item_ids("conversation.item.created")
    assert created == ["item_1", "item_2", "item_3", "item_4"]
    assert not any(e["type"] == "error" for e in live.events)
    seqs = live.seqs()
    assert seqs == list(range(1, len(seqs) + 1))
    assert (await fleet.meta(SID))["worker"] == "w-b"


async def test_a_gap_that_never_fills_is_applied_after_the_hold_and_reported_once(fleet):
    _, b, live = await moved_to_b(fleet)

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    b.table.clock = b.table.get(SID).order.clock = (
        clock  # the hold window ends when the test says so
    )
    await fleet.command("w-b", SID, 1, 3, note("item_3"))  # seq 2 never comes
    await until(lambda: asyncio.sleep(0, held(b, SID) == 1))
    assert not any((e.get("item") or {}).get("id") == "item_3" for e in live.events)
    clock.now += 1.0
    b._order_wake.set()
    lost = await live.of_type("error")
    assert lost["error"]["code"] == "input_lost" and lost["error"]["lost_commands"] == 1
    await live.item_done("item_3")
    assert live.events.index(lost) < next(
        i for i, e in enumerate(live.events) if (e.get("item") or {}).get("id") == "item_3"
    )
    await fleet.command("w-b", SID, 1, 2, note("item_2"))  # too late: dropped
    await fleet.command("w-b", SID, 1, 4, note("item_4"))
    await live.item_done("item_4")
    assert not any((e.get("item") or {}).get("id") == "item_2" for e in live.events)
    assert [e["type"] for e in live.events].count("error") == 1


async def test_commands_read_once_a_move_has_begun_go_to_the_new_worker(fleet, monkeypatch):
    """From the idle check on, the session's entries are kept back for the new worker: a
    commit reaching the old one during the move would start a response the hand-off cuts."""
    a = await fleet.worker("w-a")
    b = await fleet.worker("w-b")
    live = await fleet.open("w-a", SID)
    gate = asyncio.Event()
    find_target = Drain._target

    async def slow_target(self: Drain, model: str, sid: str) -> str | None:
        await gate.wait()  # the placement lookup takes its time
        return await find_target(self, model, sid)

    monkeypatch.setattr(Drain, "_target", slow_target)
    stopping = asyncio.create_task(fleet.stop("w-a"))
    await until(lambda: asyncio.sleep(0, a.drain is not None and kept_back(a, SID) is not None))
    await fleet.command("w-a", SID, 1, 1, note("item_1"))
    await until(lambda: asyncio.sleep(0, len(kept_back(a, SID) or ()) == 1))
    gate.set()
    await live.item_done("item_1")
    await asyncio.wait_for(stopping, 15)
    assert a.drain.forwarded == 1 and [m.session_id for m in a.drain.moves_done] == [SID]
    items = b.manager.table.runner(SID).session.conversation.items
    assert [item["id"] for item in items] == ["item_1"]
    assert not any(e["type"] == "error" for e in live.events)


async def test_past_the_drain_deadline_a_response_is_cancelled_and_its_session_moves(fleet):
    """A response still running at `drain_timeout_s` ends with the cancelled chain (reason
    shutdown), on the draining worker; then the session moves and goes on."""
    import base64

    from harness.sessions import sine
    from shared.protocol.duplex import float_to_pcm16

    a = await fleet.worker("w-a", drain_timeout_s=0.2)
    b = await fleet.worker("w-b")
    live = await fleet.open("w-a", SID)
    pcm = float_to_pcm16(sine(24_000, 3.0))  # answered in real time: 3 s of response
    audio = base64.b64encode(pcm).decode()
    await fleet.command("w-a", SID, 1, 1, {"type": "input_audio_buffer.append", "audio": audio})
    await fleet.command("w-a", SID, 1, 2, {"type": "input.commit"})
    await live.of_type("response.output_audio.delta")
    await fleet.stop("w-a")
    done = await live.of_type("response.done")
    assert done["response"]["status"] == "cancelled", done
    assert await fleet.client.hget(fleet.keys.session(SID), "worker") == b"w-b"
    assert [m.session_id for m in a.drain.moves_done] == [SID]
    await fleet.command("w-b", SID, 1, 3, note("item_after"))
    await live.item_done("item_after")
    assert SID in b.manager.table.live_ids()
    seqs = live.seqs()
    assert seqs == list(range(1, len(seqs) + 1))
    assert not any(e["type"] in ("error", "session.closed") for e in live.events)


async def test_a_drain_that_cannot_reach_redis_says_so_once_and_backs_off(
    fleet, monkeypatch, caplog
):
    """Looking for the workers to move to fails while Redis fails over: the drain says so
    once for the run and once when it works again, with the count, and pauses on its
    backoff after each failure rather than asking every poll; then it moves the session."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from shared.backoff import Backoff

    a = await fleet.worker("w-a")
    await fleet.worker("w-b")
    await fleet.open("w-a", SID)
    start_moves = Drain._start_moves
    failures = 5
    calls: list[bool] = []
    pauses: list[float] = []
    next_delay = Backoff.next_delay

    async def away(self: Drain, overdue: bool) -> None:
        calls.append(overdue)
        if len(calls) <= failures:
            raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379.")
        await start_moves(self, overdue)

    def paused(self: Backoff) -> float:
        pauses.append(next_delay(self))
        return pauses[-1]

    monkeypatch.setattr(Drain, "_start_moves", away)
    monkeypatch.setattr(Backoff, "next_delay", paused)
    caplog.set_level("INFO", logger="services.worker.drain")
    await asyncio.wait_for(fleet.stop("w-a"), 30)
    assert [m.session_id for m in a.drain.moves_done] == [SID]
    said = [r.getMessage() for r in caplog.records if "looking for workers" in r.getMessage()]
    assert len(said) == 2, said  # the run's start, and its end
    assert "works again" in said[1] and f"{failures} tries failed" in said[1], said
    assert len(pauses) >= failures  # a pause on the backoff after each failure
