"""Contract tests of every Lua script, on a real redis-server and on fakeredis."""

import asyncio
import uuid

import orjson
import pytest

from shared.ids import key_digest
from shared.redis.boundary import entry_bytes
from shared.redis.keys import KeySchema
from shared.redis.store import (
    PublishItem,
    ResumeGranted,
    ResumeResync,
    SessionStore,
    SessionStoreError,
    SessionWrite,
    token_digest,
)
from tests.redis.journal_entries import journal_bytes_held, journal_entries
from tests.redis.live_listen import LiveListener

SID = "duplex-test1"
KEYS = KeySchema()


def event(wire_type: str, n: int, pad: int = 0) -> PublishItem:
    body = {"type": wire_type, "event_id": f"event_{n:032x}", "n": n, "pad": "x" * pad}
    return PublishItem(orjson.dumps(body), wire_type)


async def opened(client, token: str = "tok-1", sid: str = SID, key: str = "") -> SessionStore:
    store = SessionStore(client)
    key_sha = key_digest(key) if key else ""
    await store.open(sid, "worker-a", "echo", token_digest(token), '{"model":"echo"}', "", key_sha)
    created = PublishItem(
        b'{"type":"session.created","event_id":"e0","session":{}}', "session.created", False, b"{}"
    )
    await store.publish(sid, [created], max_bytes=1 << 20, ttl_ms=60_000, closed_ttl_ms=60_000)
    return store


async def publish(store, items, max_bytes=1 << 20, sid=SID):
    return await store.publish(sid, items, max_bytes=max_bytes, ttl_ms=60_000, closed_ttl_ms=5_000)


async def test_open_creates_the_meta_hash_once(redis_client):
    store = await opened(redis_client)
    meta = await store.meta(SID)
    assert meta["state"] == "active" and meta["worker"] == "worker-a" and meta["model"] == "echo"
    assert (meta["lease_generation"], meta["attachment_generation"], meta["next_seq"]) == (
        "0",
        "1",
        "0",
    )
    assert meta["resume_token_sha256"] == token_digest("tok-1") and "tok-1" not in str(meta)
    with pytest.raises(SessionStoreError) as info:
        await store.open(SID, "worker-b", "echo", "", "{}")
    assert info.value.code == "session_exists"


async def test_publish_stamps_contiguous_seqs_and_journals_them(redis_client):
    # a channel of its own: on a cluster, pub/sub messages of an earlier test may still be in flight
    sid = f"duplex-{uuid.uuid4().hex}"
    listener = await LiveListener(redis_client, KEYS.live(sid)).__aenter__()
    store = await opened(redis_client, sid=sid)
    assert await publish(store, [event("a", 1), event("b", 2)], sid=sid) == [1, 2]
    unjournaled = PublishItem(b'{"type":"x"}', "x", journaled=False)
    assert await publish(store, [unjournaled, event("c", 3)], sid=sid) == [0, 3]
    journal = await store.journal(sid, 0)
    assert [seq for seq, _ in journal] == [1, 2, 3]
    assert [orjson.loads(data)["server_event_seq"] for _, data in journal] == [1, 2, 3]
    assert orjson.loads(journal[0][1])["n"] == 1  # the event itself is untouched
    assert [seq for seq, _ in await store.journal(sid, 1, 2)] == [2]
    live = await listener.records(5)
    # live order = publish order; session.created (from opening) is unsequenced; the
    # header's seq is the JSON's
    assert [r.seq for r in live] == [0, 1, 2, 0, 3]
    assert [orjson.loads(r.data).get("server_event_seq") for r in live] == [None, 1, 2, None, 3]
    await listener.__aexit__()
    meta = await store.meta(sid)
    assert meta["next_seq"] == "3"
    assert int(meta["journal_bytes"]) == await journal_bytes_held(redis_client, sid)
    # one entry per call: the second call's unjournaled event is not in it
    entries = await journal_entries(redis_client, sid)
    assert [(e.first_seq, e.last_seq) for e in entries] == [(1, 2), (3, 3)]
    assert [[r.seq for r in e.records] for e in entries] == [[1, 2], [3]]


async def test_journal_is_pruned_to_its_byte_cap(redis_client):
    # over the cap, the oldest entries go in bulk down to the low-water mark (7/8 of it)
    store = await opened(redis_client)
    items = [event("a", n, pad=100) for n in range(1, 11)]
    size = len(items[0].data) + len(',"server_event_seq":1')
    cap = size * 4 + 10
    await publish(store, items, max_bytes=cap)
    journal = await store.journal(SID, 0)
    assert [seq for seq, _ in journal] == [8, 9, 10]  # 4 entries are over 7/8 of the cap
    meta = await store.meta(SID)
    assert meta["journal_first_seq"] == "8"
    held = await journal_bytes_held(redis_client, SID)
    assert int(meta["journal_bytes"]) == held <= cap - cap // 8


async def test_an_event_over_the_cap_sets_the_sticky_overflow_flag(redis_client):
    # a channel of its own: on a cluster, pub/sub messages of an earlier test may still be in flight
    sid = f"duplex-{uuid.uuid4().hex}"
    listener = await LiveListener(redis_client, KEYS.live(sid)).__aenter__()
    store = await opened(redis_client, sid=sid)
    await publish(store, [event("a", 1)], sid=sid)
    assert await publish(
        store, [event("big", 2, pad=5000), event("after", 3)], max_bytes=1000, sid=sid
    ) == [
        0,
        0,
    ]
    meta = await store.meta(sid)
    assert meta["journal_overflow"] == "1" and await store.journal(sid, 0) == []
    # session.created, a, the notice (bare JSON), then big and after (one frame, seq 0)
    records = await listener.records(5)
    received = [orjson.loads(r.data) for r in records]
    assert [r.seq for r in records] == [0, 1, 0, 0, 0]
    assert [r["type"] for r in received] == [
        "session.created",
        "a",
        "session.resync_required",
        "big",
        "after",
    ]
    received = received[2:]
    assert (
        received[0]["type"] == "session.resync_required"
        and received[0]["reason"] == "journal_overflow"
    )
    assert received[0]["session_id"] == sid
    assert [r.get("server_event_seq") for r in received[1:]] == [None, None]  # live, unsequenced
    await listener.__aexit__()
    with pytest.raises(AssertionError):
        assert isinstance(await store.resume(sid, "tok-1", "tok-2", 1), ResumeGranted)
    assert await store.resume(sid, "tok-1", "tok-2", 1) == ResumeResync("journal_overflow")


async def test_session_closed_marks_the_hash_and_expires_the_keys(redis_client):
    store = await opened(redis_client)
    await publish(
        store, [event("a", 1), PublishItem(b'{"type":"session.closed"}', "session.closed")]
    )
    meta = await store.meta(SID)
    assert meta["state"] == "closed"
    assert 0 < await redis_client.pttl(KEYS.session(SID)) <= 5_000
    assert await publish(store, [event("late", 9)], sid="duplex-gone") == [
        -1
    ]  # no meta: nothing happens
    assert await redis_client.exists(KEYS.events("duplex-gone")) == 0


async def test_detach_is_fenced_on_the_attachment_generation(redis_client):
    store = await opened(redis_client)
    assert await store.detach("duplex-unknown", 1, 30_000) == -1
    assert (
        await store.detach(SID, 2, 30_000) == 0
    )  # an older connection of a newer attachment: no-op
    assert (await store.meta(SID))["state"] == "active"
    assert await store.detach(SID, 1, 30_000) == 1
    meta = await store.meta(SID)
    assert meta["state"] == "detached" and "detached_at" in meta
    deadline = await redis_client.zscore(KEYS.leases(), SID)
    assert deadline == pytest.approx(int(meta["detached_at"]) + 30_000)


async def test_resume_checks_the_token_rotates_it_and_bumps_the_generations(redis_client):
    store = await opened(redis_client)
    await publish(store, [event("a", 1), event("b", 2)])
    await store.detach(SID, 1, 30_000)
    with pytest.raises(SessionStoreError) as info:
        await store.resume(SID, "wrong", "tok-2", 0)
    assert info.value.code == "invalid_resume_token"
    granted = await store.resume(SID, "tok-1", "tok-2", 1)
    assert isinstance(granted, ResumeGranted)
    assert (granted.attachment_generation, granted.lease_generation, granted.worker_id) == (
        2,
        1,
        "worker-a",
    )
    assert granted.next_seq == 2 and granted.model == "echo"
    meta = await store.meta(SID)
    assert meta["state"] == "active" and "detached_at" not in meta
    assert await redis_client.zscore(KEYS.leases(), SID) is None
    with pytest.raises(SessionStoreError) as info:
        await store.resume(SID, "tok-1", "tok-3", 2)  # the rotated-out token: it lost the race
    assert info.value.code == "session_resume_conflict"
    assert isinstance(await store.resume(SID, "tok-2", "tok-3", 2), ResumeGranted)
    # events past the head: the store lost the writes that journaled them (a Redis
    # failover): a gap, not a refusal, and the token is not rotated
    assert await store.resume(SID, "tok-3", "tok-4", 99) == ResumeResync("journal_gap")
    assert isinstance(await store.resume(SID, "tok-3", "tok-4", 2), ResumeGranted)
    with pytest.raises(SessionStoreError) as info:
        await store.resume("duplex-unknown", "tok", "tok-2", 0)
    assert info.value.code == "session_resume_expired"


async def test_concurrent_resumes_have_exactly_one_winner(redis_client):
    store = await opened(redis_client)
    results = await asyncio.gather(
        *(store.resume(SID, "tok-1", f"new-{i}", 0) for i in range(5)), return_exceptions=True
    )
    winners = [r for r in results if isinstance(r, ResumeGranted)]
    losers = [r for r in results if isinstance(r, SessionStoreError)]
    assert len(winners) == 1 and len(losers) == 4
    assert {loser.code for loser in losers} == {"session_resume_conflict"}


async def test_resume_from_before_the_retained_journal_is_a_gap(redis_client):
    store = await opened(redis_client)
    await publish(store, [event("a", n, pad=100) for n in range(1, 11)], max_bytes=600)
    first = int((await store.meta(SID))["journal_first_seq"])
    assert await store.resume(SID, "tok-1", "tok-2", first - 2) == ResumeResync("journal_gap")
    assert isinstance(await store.resume(SID, "tok-1", "tok-2", first - 1), ResumeGranted)


async def test_touch_never_recreates_a_session(redis_client):
    store = await opened(redis_client)
    assert await store.touch(SID) == 1
    assert await store.touch("duplex-unknown") == 0
    assert await redis_client.exists(KEYS.session("duplex-unknown")) == 0


async def test_expiry_is_claimed_once_and_only_when_due(redis_client):
    store = await opened(redis_client)
    await store.detach(SID, 1, 0)
    await asyncio.sleep(0.01)  # time itself is tested: the zero-grace deadline has passed
    assert await store.claim_expiry(SID) == "worker-a"
    assert (await store.meta(SID))["state"] == "closing"
    assert await store.claim_expiry(SID) is None  # another janitor: nothing left to claim
    other = await opened(redis_client, sid="duplex-test2")
    await other.detach("duplex-test2", 1, 60_000)
    assert await other.claim_expiry("duplex-test2") is None  # not due yet


async def test_ack_trims_the_journal(redis_client):
    store = await opened(redis_client)
    await publish(store, [event("a", n) for n in range(1, 3)])  # entry 1-2
    await publish(store, [event("a", n) for n in range(3, 6)])  # entry 3-5
    first_entry, second_entry = await journal_entries(redis_client, SID)
    # 3 is in the middle of the second entry: the first goes whole, the second stays whole
    assert await store.ack(SID, 3) == 4
    assert await journal_entries(redis_client, SID) == [second_entry]
    assert int((await store.meta(SID))["journal_bytes"]) == second_entry.size
    assert (await store.meta(SID))["journal_first_seq"] == "4"
    # a replay from the ack skips the acknowledged records the kept entry still holds
    assert [seq for seq, _ in await store.journal(SID, 3)] == [4, 5]
    assert await store.ack(SID, 5) == 6  # the whole second entry acknowledged: it goes
    assert await journal_entries(redis_client, SID) == []
    assert int((await store.meta(SID))["journal_bytes"]) == 0 < first_entry.size
    assert await store.ack(SID, 6) == -1  # past the head
    assert await store.ack("duplex-unknown", 1) == -2
    assert await store.resume(SID, "tok-1", "tok-2", 2) == ResumeResync("journal_gap")


async def test_scripts_reload_after_a_script_flush(redis_client):
    store = await opened(redis_client)
    await redis_client.script_flush()  # on a cluster: every primary
    assert await store.touch(SID) == 1  # NOSCRIPT -> loaded again, transparently


async def test_a_touch_by_the_attachment_that_holds_it_takes_a_swept_session_back(redis_client):
    """A stalled pod's sessions are detached by a sweep; its sockets' touches reactivate
    them (same attachment generation), nobody else's do."""
    store = await opened(redis_client)
    assert await store.detach(SID, 1, 30_000, by="sweep") == 1  # what sweep_dead_apis does
    assert await store.touch(SID) == 1  # a touch without a generation only refreshes
    assert await store.touch(SID, 2, "api-b") == 1  # not the holder: stays detached
    assert (await store.meta(SID))["state"] == "detached"
    assert await store.touch(SID, 1, "api-a") == 2
    meta = await store.meta(SID)
    assert meta["state"] == "active" and meta["pod"] == "api-a"
    assert "lease_deadline" not in meta and "detached_at" not in meta
    assert await redis_client.zscore(KEYS.leases(), SID) is None  # no expiry is due
    assert await store.claim_expiry(SID) is None
    assert await store.detach(SID, 1, 30_000) == 1  # its socket closed: by="client"
    assert await store.touch(SID, 1, "api-a") == 1  # not taken back: its grace goes on
    assert (await store.meta(SID))["state"] == "detached"


async def test_a_touch_does_not_take_back_a_session_resumed_elsewhere_or_expiring(redis_client):
    store = await opened(redis_client)
    await store.detach(SID, 1, 30_000, by="sweep")
    assert isinstance(await store.resume(SID, "tok-1", "tok-2", 0, "api-b"), ResumeGranted)
    assert await store.touch(SID, 1, "api-a") == 1  # generation 2 holds it now
    assert (await store.meta(SID))["pod"] == "api-b"
    other = await opened(redis_client, sid="duplex-test2")
    await other.detach("duplex-test2", 1, 0, by="sweep")
    await asyncio.sleep(0.01)  # time itself is tested: the zero-grace deadline has passed
    assert await other.claim_expiry("duplex-test2") == "worker-a"
    assert await other.touch("duplex-test2", 1, "api-a") == 1
    assert (await other.meta("duplex-test2"))["state"] == "closing"


async def test_a_session_opened_with_a_key_resumes_only_with_that_key(redis_client):
    store = await opened(redis_client, key="k1")
    meta = await store.meta(SID)
    assert meta["key_sha256"] == key_digest("k1") and "k1" not in meta.values()
    for other_key in ("k2", ""):
        with pytest.raises(SessionStoreError) as info:
            await store.resume(SID, "tok-1", "tok-2", 0, "api-b", key_digest(other_key))
        assert info.value.code == "invalid_resume_token"  # no hint that the token was right
    granted = await store.resume(SID, "tok-1", "tok-2", 0, "api-b", key_digest("k1"))
    assert isinstance(granted, ResumeGranted)
    unkeyed = await opened(redis_client, "t", "duplex-test2")  # no keys: nothing bound
    assert isinstance(await unkeyed.resume("duplex-test2", "t", "t2", 0), ResumeGranted)


async def test_handled_inbox_entries_are_deleted_and_give_their_bytes_back(redis_client):
    store = SessionStore(redis_client)
    inbox, counter = KEYS.inbox("w"), KEYS.inbox_bytes("w")
    await redis_client.xgroup_create(inbox, "runners", id="0", mkstream=True)
    fields = {"m": b"[" + b" " * 300 + b"]", "b0": b"\x01" * 500}  # the codec's shape
    size = entry_bytes(fields)
    assert size == 802
    for _ in range(3):
        await store.inbox_append("w", fields)
    assert int(await redis_client.get(counter)) == 3 * size
    reply = await redis_client.xreadgroup("runners", "w", {inbox: ">"}, count=2)
    handled = [(entry_id, size) for entry_id, _ in reply[0][1]]
    assert await store.inbox_ack("w", handled) == 2
    assert await redis_client.xlen(inbox) == 1
    assert int(await redis_client.get(counter)) == size  # the one not handled yet
    assert (await redis_client.xpending(inbox, "runners"))["pending"] == 0
    assert await store.inbox_ack("w", handled) == 0  # sent again (a lost reply): no change
    assert int(await redis_client.get(counter)) == size
    await redis_client.set(counter, 10**9)  # drifted (say, a sweep deleted the stream)
    reply = await redis_client.xreadgroup("runners", "w", {inbox: ">"})
    await store.inbox_ack("w", [(entry_id, size) for entry_id, _ in reply[0][1]])
    assert await redis_client.xlen(inbox) == 0
    assert int(await redis_client.get(counter)) == 0  # an empty inbox holds nothing


async def test_a_backlog_of_acks_longer_than_lua_can_unpack_goes_through(redis_client):
    """After a Redis hiccup a worker may owe thousands of acks: Lua unpacks ~8000 values
    at most, so one call with them all would fail for ever."""
    store = SessionStore(redis_client)
    inbox = KEYS.inbox("w")
    await redis_client.xgroup_create(inbox, "runners", id="0", mkstream=True)
    pipeline = redis_client.pipeline(transaction=False)
    for n in range(9000):
        pipeline.xadd(inbox, {"p": str(n)})
    await pipeline.execute()
    await redis_client.set(KEYS.inbox_bytes("w"), 9000)
    reply = await redis_client.xreadgroup("runners", "w", {inbox: ">"}, count=9000)
    handled = [(entry_id, 1) for entry_id, _ in reply[0][1]]
    assert await store.inbox_ack("w", handled) == 9000
    assert await redis_client.xlen(inbox) == 0
    assert int(await redis_client.get(KEYS.inbox_bytes("w"))) == 0


# ---------------------------------------------------------------- owners and checkpoints


async def test_the_opening_worker_is_the_first_owner_and_a_stranger_writes_nothing(redis_client):
    store = await opened(redis_client)
    assert (await store.meta(SID))["owner_generation"] == "1"
    seqs = await store.publish(
        SID,
        [event("a", 1)],
        max_bytes=1 << 20,
        ttl_ms=60_000,
        closed_ttl_ms=5_000,
        owner_generation=2,
        checkpoint=b'{"v":1}',
    )
    assert seqs == [-2]  # not the owner: refused before anything is written
    assert await redis_client.xlen(KEYS.events(SID)) == 0
    assert await store.checkpoint(SID) is None
    assert (await store.meta(SID))["next_seq"] == "0"


async def test_the_checkpoint_is_stored_with_the_events_of_the_same_call(redis_client):
    store = await opened(redis_client)
    seqs = await store.publish(
        SID,
        [event("a", 1), event("b", 2)],
        max_bytes=1 << 20,
        ttl_ms=60_000,
        closed_ttl_ms=5_000,
        owner_generation=1,
        checkpoint=b'{"v":1,"epoch":3}',
    )
    assert seqs == [1, 2]
    assert await store.checkpoint(SID) == b'{"v":1,"epoch":3}'
    assert (await store.meta(SID))["checkpoints"] == "1"
    # a batch of sessions: each call fenced on its own owner generation
    other = "duplex-test2"
    await store.open(other, "worker-a", "echo", "", "{}")
    replies = await store.publish_many(
        [
            SessionWrite(SID, [event("c", 3)], owner_generation=1, checkpoint=b'{"v":2}'),
            SessionWrite(other, [event("d", 1)], owner_generation=7),
        ],
        max_bytes=1 << 20,
        ttl_ms=60_000,
        closed_ttl_ms=5_000,
    )
    assert replies == {SID: [3], other: [-2]}
    assert await store.checkpoint(SID) == b'{"v":2}'
    # a closed session keeps no checkpoint: nothing restores it
    await store.publish(
        SID,
        [PublishItem(b'{"type":"session.closed"}', "session.closed")],
        max_bytes=1 << 20,
        ttl_ms=60_000,
        closed_ttl_ms=5_000,
        owner_generation=1,
        checkpoint=b'{"v":3}',
    )
    assert await store.checkpoint(SID) is None


async def test_an_owner_move_is_a_compare_and_set_that_fences_the_old_owner(redis_client):
    store = await opened(redis_client)
    assert await store.move_owner(SID, "worker-x", "worker-b", "drain") == 0  # not its owner
    assert await store.move_owner(SID, "worker-a", "worker-b", "drain", 5) == 0  # stale gen
    moved = await store.move_owner(SID, "worker-a", "worker-b", "drain", 1, paused_at_ms=123)
    assert moved == 2
    meta = await store.meta(SID)
    assert (meta["worker"], meta["owner_generation"], meta["moved_from"]) == (
        "worker-b",
        "2",
        "worker-a",
    )
    assert (meta["moved_why"], meta["moves"], meta["paused_at"]) == ("drain", "1", "123")
    # the old owner is fenced out; the new one writes
    old = await store.publish(
        SID,
        [event("a", 1)],
        max_bytes=1 << 20,
        ttl_ms=60_000,
        closed_ttl_ms=5_000,
        owner_generation=1,
    )
    new = await store.publish(
        SID,
        [event("b", 2)],
        max_bytes=1 << 20,
        ttl_ms=60_000,
        closed_ttl_ms=5_000,
        owner_generation=2,
    )
    assert (old, new) == ([-2], [1])
    # two sweeps racing for the same session: one wins
    results = await asyncio.gather(
        store.move_owner(SID, "worker-b", "worker-c", "worker_lost"),
        store.move_owner(SID, "worker-b", "worker-d", "worker_lost"),
    )
    assert sorted(results) == [0, 3]
    await store.mark_restored(SID)
    assert "paused_at" not in await store.meta(SID)  # a failover has no pause start
    assert int((await store.meta(SID))["restored_at"]) > 0
    # a closed session moves nowhere
    await publish(store, [PublishItem(b'{"type":"session.closed"}', "session.closed")])
    owner = (await store.meta(SID))["worker"]
    assert await store.move_owner(SID, owner, "worker-e", "worker_lost") == 0
