"""The worker's side of ownership (services/worker/ownership.py): a restore it cannot take
closes the session with worker_lost, a stale restore is ignored, and a worker the
dead-worker sweep removed drops the sessions that are not its own any more. In-process
workers on a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from shared.redis.boundary import RestoreRequest
from shared.redis.keys import INBOX_GROUP
from tests.worker.test_process_fleet import Fleet, note, until

SID = "duplex-00000000000000000000000000e5a1"
KEPT = "duplex-00000000000000000000000000e5a2"


@pytest.fixture
async def fleet(redis_server):
    made = Fleet(redis_server.url)
    yield made
    await made.close()


async def placed_on(fleet: Fleet, session_id: str, worker_id: str) -> int:
    """A session that was on a lost worker `gone`, moved to `worker_id` by a sweep; its
    new owner generation."""
    await fleet.store.open(session_id, "gone", "echo", "", "{}")
    await fleet.client.hset(fleet.keys.session(session_id), "state", "active")
    generation = await fleet.store.move_owner(session_id, "gone", worker_id, "worker_lost")
    assert generation == 2
    return generation


async def test_a_restore_without_a_checkpoint_closes_the_session_with_worker_lost(fleet):
    b = await fleet.worker("w-b")
    generation = await placed_on(fleet, SID, "w-b")
    await fleet.client.sadd(fleet.keys.worker_sessions("w-b"), SID)
    live = await fleet.live(SID)
    restore = RestoreRequest(SID, generation, "worker_lost", "gone")
    await fleet.store.inbox_append("w-b", restore.to_fields())
    closed = await live.of_type("session.closed")
    assert closed["reason"] == "worker_lost"
    [error] = [e for e in live.events if e["type"] == "error"]
    assert error["error"]["code"] == "worker_lost" and error["error"]["retryable"] is True
    assert live.events.index(error) < live.events.index(closed)
    assert (await fleet.meta(SID))["state"] == "closed"
    assert not await fleet.client.sismember(fleet.keys.worker_sessions("w-b"), SID)
    assert SID not in b.manager.table.live_ids() and b.manager.table.slots_in_use == 0


async def test_a_restore_the_worker_has_no_room_for_closes_the_session(fleet):
    a = await fleet.worker("w-a", max_sessions=1)
    generation = await placed_on(fleet, SID, "w-a")
    await copy_checkpoint(fleet, "w-a", SID)  # KEPT takes its one slot
    moved = await fleet.live(SID)
    await fleet.store.inbox_append(
        "w-a", RestoreRequest(SID, generation, "worker_lost", "gone").to_fields()
    )
    closed = await moved.of_type("session.closed")
    assert closed["reason"] == "worker_lost"
    assert moved.events[0]["error"]["code"] == "worker_lost"
    assert a.manager.table.live_ids() == [KEPT]


async def copy_checkpoint(fleet: Fleet, worker_id: str, session_id: str) -> None:
    """A checkpoint for `session_id`: that of a session opened on the worker for it."""
    live = await fleet.open(worker_id, KEPT)
    await fleet.command(worker_id, KEPT, 1, 1, note("item_1"))
    await live.item_done("item_1")
    checkpoint = await fleet.store.checkpoint(KEPT)
    assert checkpoint is not None
    await fleet.client.set(
        fleet.keys.checkpoint(session_id), checkpoint.replace(KEPT.encode(), session_id.encode())
    )


async def test_a_stale_restore_is_ignored(fleet):
    """(A restore it had taken would have served a session another worker owns.)"""
    b = await fleet.worker("w-b")
    generation = await placed_on(fleet, SID, "w-b")
    await copy_checkpoint(fleet, "w-b", SID)
    # moved on again before w-b read its request
    assert await fleet.store.move_owner(SID, "w-b", "w-c", "worker_lost") == generation + 1
    live = await fleet.live(SID)
    await fleet.store.inbox_append(
        "w-b", RestoreRequest(SID, generation, "worker_lost", "gone").to_fields()
    )
    # the worker handled it (handled entries leave the inbox) and wrote nothing for it
    await until(lambda: _empty(fleet, "w-b"))
    assert await fleet.store.journal(SID, 0) == [] and live.events == []
    assert b.manager.table.live_ids() == [KEPT]
    meta = await fleet.meta(SID)
    assert (meta["state"], meta["worker"], "restored_at" in meta) == ("active", "w-c", False)


async def _empty(fleet: Fleet, worker_id: str) -> bool:
    return await fleet.client.xlen(fleet.keys.inbox(worker_id)) == 0


async def test_a_worker_the_sweep_removed_drops_the_sessions_it_lost(fleet):
    a = await fleet.worker("w-a")
    lost_live = await fleet.open("w-a", SID)
    await fleet.open("w-a", KEPT)
    assert set(a.manager.moves.owned_sessions()) == {SID, KEPT}
    # the dead-worker sweep, while w-a stalled: SID re-placed on w-b, w-a's keys deleted
    assert await fleet.store.move_owner(SID, "w-a", "w-b", "worker_lost") == 2
    await fleet.client.zrem(fleet.keys.workers(), "w-a")
    await fleet.client.delete(
        fleet.keys.worker("w-a"),
        fleet.keys.worker_sessions("w-a"),
        fleet.keys.inbox("w-a"),
        fleet.keys.inbox_bytes("w-a"),
    )
    # its next heartbeat adds it anew: it checks whom its sessions belong to
    await until(lambda: asyncio.sleep(0, SID not in a.manager.table.live_ids()))
    assert set(a.manager.moves.owned_sessions()) == {KEPT}

    # the session it kept goes back into the set the sweep deleted (just after the drop)
    async def kept_in_set() -> bool:
        return await fleet.client.smembers(fleet.keys.worker_sessions("w-a")) == {KEPT.encode()}

    await until(kept_in_set)
    groups = await fleet.client.xinfo_groups(fleet.keys.inbox("w-a"))
    assert [g["name"] for g in groups] == [INBOX_GROUP.encode()]
    # the session it kept is served on: its inbox works again
    kept_live = fleet.lives[-1]
    await fleet.command("w-a", KEPT, 1, 1, note("item_k"))
    await kept_live.item_done("item_k")
    assert not any(e["type"] == "session.closed" for e in lost_live.events)


async def test_a_worker_restarted_under_its_id_restores_the_sessions_it_left(fleet):
    """Killed and restarted faster than the heartbeat TTL, the worker is never seen dead by
    the sweep: its new process restores its sessions and applies what the old one left in
    the inbox."""
    from shared.supervised import stop_all

    old = await fleet.worker("w-a")
    live = await fleet.open("w-a", SID)
    await fleet.command("w-a", SID, 1, 1, note("item_1"))
    await live.item_done("item_1")
    # SIGKILL: the process stops reading and writing at once
    fleet.stopped.add("w-a")
    await stop_all(old._loops)
    await old.publisher.stop()
    old.publisher.emit = lambda *args: None  # a dead process sends nothing
    await fleet.command("w-a", SID, 1, 2, note("item_2"))  # unread by the dead process
    new = await fleet.worker("w-a")
    try:
        await live.item_done("item_2")
        assert new.manager.moves.owned_sessions() == {SID: 2}
        meta = await fleet.meta(SID)
        assert (meta["worker"], meta["owner_generation"], meta["moved_why"]) == (
            "w-a",
            "2",
            "worker_lost",
        )
        await fleet.command("w-a", SID, 1, 3, note("item_3"))
        await live.item_done("item_3")
        items = new.manager.table.runner(SID).session.conversation.items
        assert [item["id"] for item in items] == ["item_1", "item_2", "item_3"]
        notice = await live.notice()
        assert (notice.owner_generation, notice.worker_id) == (2, "w-a")
        assert not any(e["type"] in ("error", "session.closed") for e in live.events)
        seqs = live.seqs()
        assert seqs == list(range(1, len(seqs) + 1))
    finally:
        await new.stop()
        await old.manager.shutdown()


async def test_a_command_for_a_session_the_worker_does_not_hold_reaches_no_client(fleet):
    """An entry for a session that lives on another worker (a late one from a previous
    process, or written in the instant of a move) is dropped: an unknown_session error from
    here would reach that session's client unfenced, from a worker it left."""
    await fleet.worker("w-a")
    await fleet.worker("w-b")
    live = await fleet.open("w-b", SID)
    await fleet.command("w-a", SID, 1, 5, note("item_stray"))

    async def handled() -> bool:  # w-a read, dispatched and deleted the entry
        return await fleet.client.xlen(fleet.keys.inbox("w-a")) == 0

    await until(handled)
    await fleet.command("w-b", SID, 1, 1, note("item_real"))
    await live.item_done("item_real")
    assert not any(e["type"] == "error" for e in live.events), live.events


async def test_a_restored_session_takes_the_journals_seq_as_its_floor(fleet):
    """The new owner starts from the journal's last seq, not 0: should the store go back in
    time before its first write (a Redis failover losing the old owner's last writes), it
    never hands out a seq a client may already have."""
    b = await fleet.worker("w-b", max_sessions=2)
    generation = await placed_on(fleet, SID, "w-b")
    await copy_checkpoint(fleet, "w-b", SID)
    await fleet.client.hset(fleet.keys.session(SID), "next_seq", 42)
    await fleet.store.inbox_append(
        "w-b", RestoreRequest(SID, generation, "worker_lost", "gone").to_fields()
    )

    async def restored() -> bool:
        return b.manager.table.get(SID) is not None and SID in b.manager.table.live_ids()

    await until(restored)
    assert b.manager.table.get(SID).journaled_seq == 42
