"""One journal entry per publisher round (event_publish.lua): a replay or a gap fill from a
seq in the middle of an entry is exact, an ack keeps an entry it only partly covers, the
resume range check counts in events, and a journal an older worker began (one entry per
event) reads on with the new entries after it."""

import itertools
import random
import uuid

import orjson

from shared.redis.keys import KeySchema
from shared.redis.store import PublishItem, ResumeGranted, ResumeResync, SessionStore, token_digest
from tests.redis.journal_entries import journal_bytes_held, journal_entries

KEYS = KeySchema()
JOURNAL = {"max_bytes": 1 << 20, "ttl_ms": 60_000, "closed_ttl_ms": 5_000}


def item(n: int, response_id: str | None = "resp_1") -> PublishItem:
    body = {"type": "response.output_audio.delta", "event_id": f"event_{n}", "n": n}
    return PublishItem(orjson.dumps(body), "response.output_audio.delta", response_id=response_id)


async def opened(client) -> tuple[SessionStore, str]:
    store = SessionStore(client, KEYS)
    sid = f"duplex-{uuid.uuid4().hex}"
    await store.open(sid, "worker-a", "echo", token_digest("tok-0"), "{}")
    created = PublishItem(b'{"type":"session.created"}', "session.created", journaled=False)
    await store.publish(sid, [created], **JOURNAL)  # active: a resume may take it over
    return store, sid


async def publish_rounds(store: SessionStore, sid: str, sizes: list[int]) -> None:
    n = 0
    for size in sizes:
        await store.publish(sid, [item(n + k + 1) for k in range(size)], **JOURNAL)
        n += size


async def test_a_replay_from_any_seq_is_exact_whatever_entry_it_falls_in(redis_client):
    store, sid = await opened(redis_client)
    sizes = [3, 1, 5, 2, 4]  # entries 1-3, 4, 5-9, 10-11, 12-15
    await publish_rounds(store, sid, sizes)
    entries = await journal_entries(redis_client, sid, KEYS)
    assert [(e.first_seq, e.last_seq) for e in entries] == [
        (1, 3),
        (4, 4),
        (5, 9),
        (10, 11),
        (12, 15),
    ]
    for after in range(16):  # every seq: before, at and inside entries, and the head
        records = await store.journal_records(sid, after)
        assert [r.seq for r in records] == list(range(after + 1, 16))  # no duplicate, no hole
        assert [orjson.loads(r.data)["n"] for r in records] == list(range(after + 1, 16))
        assert all(r.response_id == "resp_1" for r in records)
    # a gap fill between two live messages: a bounded range, both ends inside entries
    rng = random.Random(6)
    for _ in range(40):
        after, until = sorted(rng.sample(range(16), 2))
        records = await store.journal_records(sid, after, until)
        assert [r.seq for r in records] == list(range(after + 1, until + 1))


async def test_an_ack_in_the_middle_of_an_entry_keeps_it_and_the_replay_past_it_whole(
    redis_client,
):
    store, sid = await opened(redis_client)
    await publish_rounds(store, sid, [3, 5])  # entries 1-3, 4-8
    assert await store.ack(sid, 6) == 7
    entries = await journal_entries(redis_client, sid, KEYS)
    assert [(e.first_seq, e.last_seq) for e in entries] == [(4, 8)]
    meta = await store.meta(sid)
    assert int(meta["journal_bytes"]) == await journal_bytes_held(redis_client, sid, KEYS)
    assert meta["journal_first_seq"] == "7"
    assert [r.seq for r in await store.journal_records(sid, 6)] == [7, 8]


async def test_the_resume_range_check_counts_in_events_not_entries(redis_client):
    store, sid = await opened(redis_client)
    await publish_rounds(store, sid, [3, 5])  # entries 1-3, 4-8
    await store.ack(sid, 5)  # the entry 4-8 stays, seqs up to 5 acknowledged
    assert await store.resume(sid, "tok-0", "tok-1", 3) == ResumeResync("journal_gap")
    granted = await store.resume(sid, "tok-0", "tok-1", 5)
    assert isinstance(granted, ResumeGranted) and granted.next_seq == 8
    # trimmed by the cap: whole entries go; the first seq kept is the oldest entry's first
    store2, sid2 = await opened(redis_client)
    pad = {"type": "e", "event_id": "e", "pad": "x" * 200}
    big = [PublishItem(orjson.dumps({**pad, "n": n}), "e") for n in range(4)]
    cap = 1600
    journal = {**JOURNAL, "max_bytes": cap}
    for _ in range(3):  # rounds of 4 events near 250 bytes: cap / 8 = 200 cuts them
        await store2.publish(sid2, big, **journal)
    entries = await journal_entries(redis_client, sid2, KEYS)
    first = int((await store2.meta(sid2))["journal_first_seq"])
    assert first > 1 and first == entries[0].first_seq
    assert sum(e.size for e in entries) <= cap - cap // 8
    assert await store2.resume(sid2, "tok-0", "tok-1", first - 2) == ResumeResync("journal_gap")
    assert isinstance(await store2.resume(sid2, "tok-0", "tok-1", first - 1), ResumeGranted)


async def test_a_round_larger_than_an_eighth_of_the_cap_is_cut_into_entries(redis_client):
    store, sid = await opened(redis_client)
    cap = 4000  # entries of at most 500 bytes unless one record alone is larger
    items = [item(n) for n in range(1, 21)]  # about 110 bytes framed each
    await store.publish(sid, items, **{**JOURNAL, "max_bytes": cap})
    entries = await journal_entries(redis_client, sid, KEYS)
    assert len(entries) > 1 and all(e.size <= cap // 8 for e in entries)
    assert [r.seq for e in entries for r in e.records] == list(range(1, 21))
    assert all(
        later.first_seq == earlier.last_seq + 1 for earlier, later in itertools.pairwise(entries)
    )
    assert [r.seq for r in await store.journal_records(sid, 0)] == list(range(1, 21))


async def test_a_journal_begun_by_an_older_worker_reads_on_and_trims(redis_client):
    """Entries of one event each (`<seq>-1`, fields type, data, rid) ahead of rounds."""
    store, sid = await opened(redis_client)
    stream = KEYS.events(sid)
    old_bytes = 0
    for seq in (1, 2):
        data = orjson.dumps({"type": "e", "n": seq, "server_event_seq": seq})
        await redis_client.xadd(stream, {"type": "e", "data": data, "rid": "r_old"}, id=f"{seq}-1")
        old_bytes += len(data)
    await redis_client.hset(KEYS.session(sid), mapping={"next_seq": 2, "journal_bytes": old_bytes})
    assert await store.publish(sid, [item(3), item(4)], **JOURNAL) == [3, 4]
    records = await store.journal_records(sid, 1)
    assert [(r.seq, r.response_id) for r in records] == [(2, "r_old"), (3, "resp_1"), (4, "resp_1")]
    assert await store.ack(sid, 2) == 3  # the old entries go whole, with their bytes
    meta = await store.meta(sid)
    assert int(meta["journal_bytes"]) == await journal_bytes_held(redis_client, sid, KEYS)
    assert [r.seq for r in await store.journal_records(sid, 0)] == [3, 4]


async def test_an_ack_of_more_entries_than_one_xdel_takes_frees_them_all(redis_client):
    store, sid = await opened(redis_client)
    for n in range(1, 1202):  # one round each: XDEL goes in slices of 1000 ids
        await store.publish(sid, [item(n)], **JOURNAL)
    assert await store.ack(sid, 1200) == 1201
    entries = await journal_entries(redis_client, sid, KEYS)
    assert [(e.first_seq, e.last_seq) for e in entries] == [(1201, 1201)]
    assert int((await store.meta(sid))["journal_bytes"]) == entries[0].size
