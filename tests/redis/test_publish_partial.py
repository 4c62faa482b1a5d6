"""A cluster master lost while a worker publishes: the sessions on the other masters are
written once and settled, only the lost master's go back (before, one shard's failure put
back every session's round, and the rounds the live masters had written were journaled
again under new seqs). Real processes: a 3-master cluster, one master SIGKILLed; and the
publisher's side with a store that reports a partial publish."""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest
from redis.exceptions import RedisError

from harness.redis_cluster import RedisClusterServers
from shared.backoff import Backoff
from shared.protocol.duplex import RateLimitsUpdated
from shared.redis.connection import connect
from shared.redis.store import PartialPublish, PublishItem, SessionStore, SessionWrite
from tests.redis.cluster_ops import kill
from tests.redis.test_journal_rounds import JOURNAL, KEYS
from tests.worker.publishing import own, publisher_on


def event(n: int) -> PublishItem:
    return PublishItem(orjson.dumps({"type": "rate_limits.updated", "n": n}), "rate_limits.updated")


@pytest.fixture
def cluster():
    servers = RedisClusterServers()
    yield servers
    servers.stop()


async def sessions_on_two_masters(store: SessionStore, client) -> tuple[str, str, int]:
    """(a session on one master, a session on the client's default node, that node's port):
    the default node is the one redis-py leaned on for everything (the worst to lose)."""
    await client.initialize()
    default = client.get_default_node().port

    def session_where(wanted) -> str:
        while True:
            sid = f"duplex-{uuid.uuid4().hex}"
            if wanted(client.get_node_from_key(KEYS.session(sid)).port):
                return sid

    sid_a = session_where(lambda port: port != default)
    sid_b, port_b = session_where(lambda port: port == default), default
    for sid in (sid_a, sid_b):
        await store.open(sid, "worker-a", "echo", "", "{}")
    for script in store.scripts.all():  # as a worker's start loads them on every master
        await script.ensure_loaded(client)
    return sid_a, sid_b, port_b


async def test_a_lost_master_fails_only_its_own_sessions_and_nothing_is_written_twice(
    cluster,
):
    """One master SIGKILLed while a batch goes out. redis-py's cluster client refreshes its
    slot map on the lost node's error, which can fail the calls in flight to the live
    masters too, after Redis ran them, and it sends a failed call again by itself: each
    call carries its round's token, so whatever was sent how often, the live master's
    session has its event once, and the lost master's session's call failed."""
    handle = connect(cluster.url)
    store = SessionStore(handle.client, KEYS)
    try:
        alive, lost, lost_port = await sessions_on_two_masters(store, handle.client)
        kill(cluster, lost_port)
        writes = [
            SessionWrite(sid, [event(1)], round_token=f"round-{sid}") for sid in (alive, lost)
        ]
        try:
            replies = await store.publish_many(writes, **JOURNAL)
        except PartialPublish as partial:
            assert lost in partial.failed
            replies = partial.written
        # the publisher sends the failed rounds again as they were, under their tokens
        async with asyncio.timeout(30):
            while alive not in replies:
                try:
                    replies.update(await store.publish_many([writes[0]], **JOURNAL))
                except (PartialPublish, RedisError):
                    await asyncio.sleep(0.1)
        assert replies[alive] == [1]
        assert [r.seq for r in await store.journal_records(alive, 0)] == [1]
        meta = await store.meta(alive)
        assert (meta["next_seq"], meta["last_round"]) == ("1", f"round-{alive}")
    finally:
        await handle.close()


async def test_a_round_sent_again_under_its_token_is_answered_not_written(redis_client):
    """A call whose reply was lost, sent again (by the publisher or by redis-py): the
    reply of the first, nothing journaled or published twice; a new token writes anew."""
    store = SessionStore(redis_client, KEYS)
    sid = f"duplex-{uuid.uuid4().hex}"
    await store.open(sid, "worker-a", "echo", "", "{}")
    write = SessionWrite(sid, [event(1), event(2)], round_token="round-1")
    first = await store.publish_many([write], **JOURNAL)
    again = await store.publish_many([write], **JOURNAL)
    assert first == again == {sid: [1, 2]}
    assert [r.seq for r in await store.journal_records(sid, 0)] == [1, 2]
    later = SessionWrite(sid, [event(3)], round_token="round-2")
    assert await store.publish_many([later], **JOURNAL) == {sid: [3]}


class HalfWritten:
    """A store whose first publish_many writes the first session only (its master answers)
    and fails the second (its master is away): what a cluster does in a failover."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self.client = store.client
        self.calls: list[list[str]] = []

    async def publish_many(self, writes, **journal):
        self.calls.append([w.session_id for w in writes])
        if len(self.calls) == 1:
            first, *rest = writes
            written = await self.store.publish_many([first], **journal)
            raise PartialPublish(written, {w.session_id: ConnectionError("gone") for w in rest})
        return await self.store.publish_many(writes, **journal)


async def test_the_publisher_sends_again_only_what_was_not_written():
    handle = connect(None)
    store = SessionStore(handle.client, KEYS)
    for sid in ("duplex-alive", "duplex-lost"):
        await store.open(sid, "w", "echo", "", "{}")
    half = HalfWritten(store)
    publisher = publisher_on(half)  # type: ignore[arg-type]
    for sid in ("duplex-alive", "duplex-lost"):
        own(publisher, sid, 1)
    publisher.start()
    try:
        for sid in ("duplex-alive", "duplex-lost"):
            publisher.emit(sid, RateLimitsUpdated(rate_limits=[]))
        async with asyncio.timeout(10):
            await publisher.flush()
        # the second try sent the lost session's round alone
        assert half.calls == [["duplex-alive", "duplex-lost"], ["duplex-lost"]]
        for sid in ("duplex-alive", "duplex-lost"):
            assert [r.seq for r in await store.journal_records(sid, 0)] == [1]  # once each
    finally:
        await publisher.stop()
        await handle.close()


class OneMasterAway:
    """A store on a cluster whose master of `lost` is away: its calls fail, the other
    sessions' are written (what `publish_many` raises as PartialPublish)."""

    def __init__(self, store: SessionStore, lost: str) -> None:
        self.store = store
        self.client = store.client
        self.lost = lost

    async def publish_many(self, writes, **journal):
        failing = [w for w in writes if w.session_id == self.lost]
        kept = [w for w in writes if w not in failing]
        written = await self.store.publish_many(kept, **journal) if kept else {}
        if failing:
            raise PartialPublish(written, {w.session_id: ConnectionError("away") for w in failing})
        return written


async def test_the_sessions_on_other_masters_do_not_wait_for_the_lost_ones_pause():
    """A session whose master is away waits its retry pause (here 60 s, so that waiting
    for it would show); a session on another master is written at once, event after
    event, meanwhile. Before, every batch carried the failed round again, failed again,
    and the whole publisher slept the pause."""
    handle = connect(None)
    store = SessionStore(handle.client, KEYS)
    for sid in ("duplex-healthy", "duplex-away"):
        await store.open(sid, "w", "echo", "", "{}")
    publisher = publisher_on(OneMasterAway(store, "duplex-away"))  # type: ignore[arg-type]
    publisher._backoff = Backoff(initial_s=60, max_s=60)
    for sid in ("duplex-healthy", "duplex-away"):
        own(publisher, sid, 1)
    publisher.start()
    try:
        publisher.emit("duplex-away", RateLimitsUpdated(rate_limits=[]))
        publisher.emit("duplex-healthy", RateLimitsUpdated(rate_limits=[]))
        for n in range(1, 6):

            async def written(n=n) -> bool:
                return len(await store.journal_records("duplex-healthy", 0)) >= n

            async with asyncio.timeout(20):  # far below the 60 s pause
                while not await written():
                    await asyncio.sleep(0.01)
            publisher.emit("duplex-healthy", RateLimitsUpdated(rate_limits=[]))
        assert await store.journal_records("duplex-away", 0) == []
    finally:
        await publisher.stop()
        await handle.close()
