"""The writer's seq floor (event_publish.lua): a store that went back in time, as a Redis
failover leaves it when the promoted replica had not received the last writes, never hands
out a seq a client may already have. The next call moves next_seq past the floor, starts
the journal over after it (a client behind the gap resyncs, one at the floor resumes
without a hole) and counts the regression for operators."""

from __future__ import annotations

from shared.redis.store import ResumeGranted, ResumeResync, SessionWrite
from tests.redis.test_journal_rounds import JOURNAL, KEYS, item, opened


async def lose_writes_after(client, sid: str, seq: int) -> None:
    """What the promoted replica holds: the session as it was after `seq` (journal entries
    past it gone, next_seq back to it; one event per entry in these tests)."""
    kept = [(entry_id, fields) for entry_id, fields in await client.xrange(KEYS.events(sid))
            if int(entry_id.split(b"-")[0]) <= seq]
    await client.delete(KEYS.events(sid))
    for entry_id, fields in kept:
        await client.xadd(KEYS.events(sid), fields, id=entry_id)
    await client.hset(KEYS.session(sid), mapping={"next_seq": seq})


async def publish(store, sid: str, n: int, floor: int) -> list[int]:
    replies = await store.publish_many(
        [SessionWrite(sid, [item(n)], seq_floor=floor)], **JOURNAL
    )
    return replies[sid]


async def test_a_store_behind_the_writers_floor_never_reuses_a_seq(redis_client):
    store, sid = await opened(redis_client)
    floor = 0
    for n in range(1, 6):
        [floor] = await publish(store, sid, n, floor)
    assert floor == 5
    await lose_writes_after(redis_client, sid, 2)  # seqs 3-5 reached clients, then were lost
    assert await publish(store, sid, 6, floor) == [6]  # not 3
    meta = await store.meta(sid)
    assert (meta["next_seq"], meta["seq_regressions"], meta["journal_first_seq"]) == (
        "6",
        "1",
        "6",
    )
    # the journal starts over after the floor: nothing from before the gap is replayed
    assert [r.seq for r in await store.journal_records(sid, 0)] == [6]
    # a client that had everything to the floor resumes without a hole; one behind it
    # (it had 2, the store had lost 3-5) resyncs
    assert isinstance(await store.resume(sid, "tok-0", "tok-1", 5), ResumeGranted)
    assert await store.resume(sid, "tok-1", "tok-2", 2) == ResumeResync("journal_gap")
    # at or above the floor, nothing changes
    assert await publish(store, sid, 7, 6) == [7]
    assert (await store.meta(sid))["seq_regressions"] == "1"


async def test_a_writer_without_a_floor_writes_as_before(redis_client):
    store, sid = await opened(redis_client)
    assert await publish(store, sid, 1, 0) == [1]
    assert await publish(store, sid, 2, 0) == [2]
    meta = await store.meta(sid)
    assert "seq_regressions" not in meta and meta["journal_first_seq"] == "1"


async def test_a_move_the_store_lost_stands_and_the_old_owner_stays_fenced(redis_client):
    """A drain moved the session from worker-a to worker-b (owner generation 2), then a
    failover lost that write: the store says worker-a at 1 again. worker-b's first call sets
    the move back (it holds the session; worker-a stopped serving it before the move), so
    commands route to it and worker-a's writes, should it still have any, are refused."""
    store, sid = await opened(redis_client)  # worker-a, generation 1
    assert await store.move_owner(sid, "worker-a", "worker-b", "drain", 1) == 2
    lost = {"owner_generation": 1, "worker": "worker-a"}
    await redis_client.hset(KEYS.session(sid), mapping=lost)
    write = SessionWrite(sid, [item(1)], owner_generation=2, worker_id="worker-b")
    assert (await store.publish_many([write], **JOURNAL))[sid] == [1]
    meta = await store.meta(sid)
    assert (meta["worker"], meta["owner_generation"], meta["owner_regressions"]) == (
        "worker-b",
        "2",
        "1",
    )
    stale = SessionWrite(sid, [item(2)], owner_generation=1, worker_id="worker-a")
    assert (await store.publish_many([stale], **JOURNAL))[sid] == [-2]
    # a writer that does not say who it is (the janitor, an operator) never moves it
    unnamed = SessionWrite(sid, [item(3)], owner_generation=3)
    assert (await store.publish_many([unnamed], **JOURNAL))[sid] == [-2]
    assert (await store.meta(sid))["owner_generation"] == "2"


async def test_a_lost_moves_number_handed_out_again_leaves_one_owner(redis_client):
    """A drain moved the session worker-a -> worker-b at generation 2 and the failover lost
    it; before worker-b wrote, the janitor re-placed the session from worker-a (its beat
    stale) to worker-c, at generation 2 again. One owner only: the store's (worker-c)."""
    store, sid = await opened(redis_client)
    lost = {"owner_generation": 1, "worker": "worker-a"}
    assert await store.move_owner(sid, "worker-a", "worker-b", "drain", 1) == 2
    await redis_client.hset(KEYS.session(sid), mapping=lost)  # the failover lost it
    assert await store.move_owner(sid, "worker-a", "worker-c", "worker_lost", 1) == 2
    by_b = SessionWrite(sid, [item(1)], owner_generation=2, worker_id="worker-b")
    by_c = SessionWrite(sid, [item(2)], owner_generation=2, worker_id="worker-c")
    assert (await store.publish_many([by_b], **JOURNAL))[sid] == [-2]
    assert (await store.publish_many([by_c], **JOURNAL))[sid] == [1]
    assert (await store.meta(sid))["worker"] == "worker-c"


async def test_a_round_retried_after_a_move_gets_its_reply_not_a_refusal(redis_client):
    """The round's call was written, its reply lost; the session moved on before the retry:
    the retry is answered with what it wrote (a drain's final checkpoint reported written)."""
    store, sid = await opened(redis_client)
    write = SessionWrite(sid, [item(1)], owner_generation=1, worker_id="worker-a", round_token="t1")
    assert (await store.publish_many([write], **JOURNAL))[sid] == [1]
    assert await store.move_owner(sid, "worker-a", "worker-b", "drain", 1) == 2
    assert (await store.publish_many([write], **JOURNAL))[sid] == [1]
