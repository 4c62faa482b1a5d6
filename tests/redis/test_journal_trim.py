"""event_publish.lua's journal upkeep: bulk trimming to the low-water mark with exact byte
accounting, replay still exact after it, and the TTL refreshed only when due (an expired
journal found and counted afresh, a closed session's TTL left alone)."""

import asyncio
import random
import uuid

import orjson

from shared.redis.keys import KeySchema
from shared.redis.store import PublishItem, SessionStore, token_digest
from tests.redis.journal_entries import journal_bytes_held, journal_entries

KEYS = KeySchema()
CAP = 20_000
LOW_WATER = CAP - CAP // 8


def item(n: int, pad: int) -> PublishItem:
    body = {"type": "e", "event_id": f"event_{n}", "pad": "x" * pad}
    return PublishItem(orjson.dumps(body), "e", response_id=f"resp_{n % 3}")


async def opened(client) -> tuple[SessionStore, str]:
    store = SessionStore(client, KEYS)
    sid = f"duplex-{uuid.uuid4().hex}"
    await store.open(sid, "worker-a", "echo", token_digest("tok"), "{}")
    return store, sid


async def test_bulk_trimming_keeps_the_bytes_exact_and_the_replay_whole(redis_client):
    store, sid = await opened(redis_client)
    rng = random.Random(18)
    published: dict[int, bytes] = {}  # seq -> the JSON as journaled
    n = 0
    trims = splits = 0
    round_starts: set[int] = set()
    rounds = 80
    for _ in range(rounds):
        items = []
        for _ in range(rng.randint(1, 12)):  # some rounds past CAP / 8: cut in two entries
            n += 1
            items.append(item(n, rng.randint(0, 300)))
        first_before = int((await store.meta(sid))["journal_first_seq"])
        seqs = await store.publish(sid, items, max_bytes=CAP, ttl_ms=60_000, closed_ttl_ms=5_000)
        round_starts.add(seqs[0])
        records = await store.journal_records(sid, 0)
        for record in records:
            published.setdefault(record.seq, record.data)
        meta = await store.meta(sid)
        first = int(meta["journal_first_seq"])
        trims += first != first_before
        entries = await journal_entries(redis_client, sid, KEYS)
        # whole entries trimmed: the first retained seq is the oldest entry's first
        assert entries[0].first_seq == first
        # an entry is one round, cut only where it would grow past an eighth of the cap
        assert all(e.size <= CAP // 8 or len(e.records) == 1 for e in entries)
        splits += sum(e.first_seq in round_starts for e in entries) < len(entries)
        # exact: the count is the sum of what the journal holds, never over the cap
        assert int(meta["journal_bytes"]) == sum(e.size for e in entries) <= CAP
        # whole: contiguous from the first retained seq up to the head, as published
        assert [r.seq for r in records] == list(range(first, seqs[-1] + 1))
        assert all(published[r.seq] == r.data for r in records)
        assert all(r.response_id == f"resp_{r.seq % 3}" for r in records)  # seq = n here
        if first != first_before:  # a trim went down to the low-water mark, not just under
            assert int(meta["journal_bytes"]) <= LOW_WATER
    assert 3 <= trims < rounds // 2  # the scenario did trim, in bulk: not on every round
    assert splits > 0  # and some rounds were too large for one entry


async def test_a_journal_that_expired_is_counted_afresh(redis_client):
    store, sid = await opened(redis_client)
    journal = {"max_bytes": CAP, "ttl_ms": 400, "closed_ttl_ms": 5_000}
    assert await store.publish(sid, [item(1, 500), item(2, 500)], **journal) == [1, 2]
    assert 0 < await redis_client.pttl(KEYS.events(sid)) <= 600  # 1.5x the TTL at most
    async with asyncio.timeout(10):
        while await redis_client.exists(KEYS.events(sid)):  # Redis expires it
            await asyncio.sleep(0.05)
    assert await store.publish(sid, [item(3, 10)], **journal) == [3]
    meta = await store.meta(sid)
    [record] = await store.journal_records(sid, 0)
    assert record.seq == 3 and int(meta["journal_first_seq"]) == 3
    # not the expired entries' bytes
    assert int(meta["journal_bytes"]) == await journal_bytes_held(redis_client, sid, KEYS)
    assert await redis_client.pttl(KEYS.events(sid)) > 0  # the new journal expires too


async def test_the_ttl_is_refreshed_when_due_not_on_every_call(redis_client):
    store, sid = await opened(redis_client)
    journal = {"max_bytes": CAP, "ttl_ms": 60_000, "closed_ttl_ms": 5_000}
    await store.publish(sid, [item(1, 10)], **journal)
    expires_at = (await store.meta(sid))["journal_expires_at"]
    await redis_client.pexpire(KEYS.events(sid), 50_000)  # as if time had passed
    await store.publish(sid, [item(2, 10)], **journal)
    # not due (more than the TTL left by the stored deadline): left as it was
    assert (await store.meta(sid))["journal_expires_at"] == expires_at
    assert await redis_client.pttl(KEYS.events(sid)) <= 50_000
    await redis_client.hset(KEYS.session(sid), "journal_expires_at", 0)  # now it is due
    await store.publish(sid, [item(3, 10)], **journal)
    assert await redis_client.pttl(KEYS.events(sid)) > 60_000  # renewed to 1.5x


async def test_a_closed_sessions_journal_keeps_the_closed_ttl(redis_client):
    store, sid = await opened(redis_client)
    journal = {"max_bytes": CAP, "ttl_ms": 60_000, "closed_ttl_ms": 5_000}
    await redis_client.hset(KEYS.session(sid), "journal_expires_at", 0)  # a refresh is due
    closed = PublishItem(b'{"type":"session.closed"}', "session.closed")
    assert await store.publish(sid, [item(1, 10), closed], **journal) == [1, 2]
    assert 0 < await redis_client.pttl(KEYS.events(sid)) <= 5_000
    assert 0 < await redis_client.pttl(KEYS.session(sid)) <= 5_000
    await store.publish(sid, [item(3, 10)], **journal)  # a straggler: no renewal
    assert 0 < await redis_client.pttl(KEYS.events(sid)) <= 5_000
