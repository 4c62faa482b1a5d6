"""Sharded pub/sub on a real 3-master Redis Cluster (shared/redis/sharded_pubsub.py behind
services/api/live.py): the API pod's `LiveHub` SSUBSCRIBEs each live channel on the master
that owns its slot, publishers SPUBLISH, and the subscription follows its slot through a
resharding, a stale slot map (MOVED) and a master killed and started again, with
`CATCH_UP` after each resubscription.

This module has a cluster of its own: it moves slots and restarts nodes."""

import asyncio
import itertools
import uuid

import pytest

from harness.redis_cluster import RedisClusterServers
from services.api.live import CATCH_UP, LiveFeed, LiveHub
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from shared.redis.sharded_pubsub import ShardedSubscriber
from shared.redis.slot_map import slot_of
from tests.redis.cluster_ops import (
    add_replica,
    cluster_ok,
    eventually,
    kill,
    node,
    reshard,
    restart,
    shard_subscribers,
    slot_owner,
    take_over,
)

KEYS = KeySchema()


@pytest.fixture(scope="module")
def servers():
    servers = RedisClusterServers()
    yield servers
    servers.stop()


@pytest.fixture
async def handle(servers):
    handle = connect(servers.url)
    yield handle
    await handle.close()


@pytest.fixture
async def hub(handle):
    hub = LiveHub(handle.pubsub_client(), KEYS.api("api-sharded"))
    await hub.start()
    yield hub
    await hub.stop()


def channel() -> str:
    return KEYS.live(f"duplex-{uuid.uuid4().hex[:12]}")


async def next_data(feed: LiveFeed, timeout_s: float = 20.0) -> bytes:
    return await asyncio.wait_for(feed.get(), timeout_s)


async def until(feed: LiveFeed, wanted: bytes) -> list[bytes]:
    """Everything the feed hears up to and including `wanted`."""
    heard = [await next_data(feed)]
    while heard[-1] != wanted:
        heard.append(await next_data(feed))
    return heard


async def test_live_events_reach_a_subscriber_through_ssubscribe_on_the_owner(servers, handle, hub):
    assert hub.sharded is not None and hub.connected.is_set()
    live = channel()
    feed = LiveFeed()
    await hub.subscribe(live, feed.push)
    owner = await slot_owner(servers, slot_of(live))
    assert await shard_subscribers(owner, live) == 1
    for port in servers.ports:  # nobody SUBSCRIBEd classically, anywhere
        client = node(port)
        assert await client.execute_command("PUBSUB NUMSUB", live) == [(live.encode(), 0)]
        await client.aclose()
    assert await handle.publish(live, b"\x00header{json}") == 1  # SPUBLISH: one subscriber
    await hub.publish(live, b"!moved 2 w-b")  # a control notice through the hub
    assert [await next_data(feed), await next_data(feed)] == [b"\x00header{json}", b"!moved 2 w-b"]


async def test_unsubscribing_the_last_subscriber_sends_sunsubscribe(servers, handle, hub):
    live = channel()
    owner = await slot_owner(servers, slot_of(live))
    first, second = LiveFeed(), LiveFeed()
    await hub.subscribe(live, first.push)
    await hub.subscribe(live, second.push)
    await hub.unsubscribe(live, first.push)
    assert hub.listening(live) and await shard_subscribers(owner, live) == 1
    await handle.publish(live, b"e1")
    assert await next_data(second) == b"e1"
    await hub.unsubscribe(live, second.push)
    assert not hub.listening(live)

    async def gone() -> bool:
        return await shard_subscribers(owner, live) == 0

    await eventually(gone, what="the SUNSUBSCRIBE")
    assert await handle.publish(live, b"e2") == 0  # nobody hears it any more
    assert first._queue.empty() and second._queue.empty()


async def test_a_stale_slot_map_is_corrected_by_the_moved_reply(servers, handle):
    live = channel()
    owner = await slot_owner(servers, slot_of(live))
    heard: list[tuple[str, bytes]] = []
    resubscribed: list[str] = []
    subscriber = ShardedSubscriber.of_cluster(
        handle.client, lambda c, d: heard.append((c, d)), resubscribed.append
    )
    await subscriber.start()
    wrong = next(p for p in servers.ports if p != owner)
    subscriber.slots.learn(slot_of(live), ("127.0.0.1", wrong))  # as if the slot had moved
    try:
        await subscriber.subscribe(live)  # SSUBSCRIBE on `wrong`: MOVED to the owner
        assert subscriber.subscribed(live)
        assert await shard_subscribers(owner, live) == 1
        assert await shard_subscribers(wrong, live) == 0
        assert subscriber.slots.owner(live) == ("127.0.0.1", owner)
        assert await handle.publish(live, b"e1") == 1

        async def arrived() -> bool:
            return bool(heard)

        await eventually(arrived, what="the message")
        assert heard == [(live, b"e1")]
        assert resubscribed == []  # the first subscribe: nothing was missed
    finally:
        await subscriber.stop()


async def test_an_unsubscribe_and_a_subscribe_in_flight_together_leave_one_subscription(
    servers, handle
):
    live = channel()
    owner = await slot_owner(servers, slot_of(live))
    heard: list[bytes] = []
    resubscribed: list[str] = []
    subscriber = ShardedSubscriber.of_cluster(
        handle.client, lambda _c, d: heard.append(d), resubscribed.append
    )
    await subscriber.start()
    try:
        await subscriber.subscribe(live)
        # SUNSUBSCRIBE then SSUBSCRIBE on the wire before either reply is read: the first
        # `sunsubscribe` is the reply to ours, not the server dropping the channel
        await asyncio.gather(subscriber.unsubscribe(live), subscriber.subscribe(live))
        assert subscriber.subscribed(live)
        assert await shard_subscribers(owner, live) == 1
        assert await handle.publish(live, b"e1") == 1

        async def arrived() -> bool:
            return heard == [b"e1"]

        await eventually(arrived, what="the message")
        assert resubscribed == []  # no channel was lost: no catch-up
        await subscriber.unsubscribe(live)

        async def gone() -> bool:
            return await shard_subscribers(owner, live) == 0

        await eventually(gone, what="the SUNSUBSCRIBE")
    finally:
        await subscriber.stop()


async def test_an_unsubscribe_lets_a_subscribe_waiting_for_its_confirmation_return(servers, handle):
    """A session that ends while its subscribe is in flight: the subscribe returns at once,
    not after `confirm_timeout_s` (its confirmation never comes: the channel is no longer
    wanted)."""
    live = channel()
    owner = await slot_owner(servers, slot_of(live))
    subscriber = ShardedSubscriber.of_cluster(
        handle.client, lambda _c, _d: None, lambda _c: None, confirm_timeout_s=30.0
    )
    await subscriber.start()
    subscribing = asyncio.create_task(subscriber.subscribe(live))
    try:
        while live not in subscriber._waiters:  # the subscribe is waiting for its reply
            await asyncio.sleep(0)
        await subscriber.unsubscribe(live)
        done, _ = await asyncio.wait({subscribing}, timeout=10)  # a third of the timeout
        assert subscribing in done and subscribing.exception() is None
        assert not subscriber.subscribed(live)
        assert await shard_subscribers(owner, live) == 0
    finally:
        subscribing.cancel()
        await asyncio.gather(subscribing, return_exceptions=True)
        await subscriber.stop()


async def test_a_slot_resharded_while_messages_flow_moves_the_subscription_to_its_new_owner(
    servers, handle, hub
):
    sid = f"duplex-{uuid.uuid4().hex[:12]}"
    live = KEYS.live(sid)
    await handle.client.hset(KEYS.session(sid), "state", "active")  # a key to MIGRATE
    feed = LiveFeed()
    await hub.subscribe(live, feed.push)
    source = await slot_owner(servers, slot_of(live))
    target = next(p for p in servers.ports if p != source)
    counter = itertools.count()
    stop = asyncio.Event()

    async def publish_forever() -> None:  # the worker's side: SPUBLISH, following MOVED
        while not stop.is_set():
            await handle.publish(live, str(next(counter)).encode())
            await asyncio.sleep(0.002)

    publisher = asyncio.create_task(publish_forever())
    try:
        assert await next_data(feed) == b"0"  # flowing before the move
        await reshard(servers, live, target)
        heard = await until(feed, CATCH_UP)
        after_catch_up = await next_data(feed)
    finally:
        stop.set()
        await publisher
    # numbered messages in publish order up to the move; later ones arrive after CATCH_UP
    numbers = [int(h) for h in heard[:-1]]
    assert numbers == sorted(numbers) and int(after_catch_up) > numbers[-1]
    assert await slot_owner(servers, slot_of(live)) == target
    assert await shard_subscribers(target, live) == 1
    assert await shard_subscribers(source, live) == 0
    assert await handle.client.hget(KEYS.session(sid), "state") == b"active"  # key moved
    assert hub.connected.is_set()


async def test_a_restarted_master_is_reconnected_resubscribed_and_caught_up(servers, handle, hub):
    live = channel()
    other = channel()
    owner = await slot_owner(servers, slot_of(live))
    while await slot_owner(servers, slot_of(other)) == owner:
        other = channel()  # a channel on a master that stays up
    feed, bystander = LiveFeed(), LiveFeed()
    await hub.subscribe(live, feed.push)
    await hub.subscribe(other, bystander.push)
    kill(servers, owner)

    async def unready() -> bool:
        return not hub.connected.is_set()

    await eventually(unready, what="readiness to drop with the master")
    shard = hub.sharded._shards[("127.0.0.1", owner)]

    async def refused() -> bool:  # a reconnect found nobody there: the backoff path
        return shard.loop.failures >= 2

    await eventually(refused, what="a refused reconnect")
    restart(servers, owner)
    await eventually(lambda: cluster_ok(owner), what="the restarted master")
    assert await next_data(feed) == CATCH_UP  # the journal fills whatever was missed
    assert hub.connected.is_set()
    assert await shard_subscribers(owner, live) == 1

    async def delivered() -> bool:  # the cluster client may need a retry after the restart
        try:
            return await handle.publish(live, b"after") == 1
        except Exception:
            return False

    await eventually(delivered, what="a publish to the restarted master")
    assert await next_data(feed) == b"after"
    await handle.publish(other, b"still")
    assert await next_data(bystander) == b"still"  # no CATCH_UP: its master never left


async def test_a_failed_over_master_moves_the_subscription_to_the_promoted_replica(
    servers, handle, hub
):
    """Last in the module: the dead master stays dead (its replica holds its slots)."""
    live = channel()
    while (owner := await slot_owner(servers, slot_of(live))) == servers.ports[0]:
        live = channel()  # keep the clients' seed node alive
    replica = await add_replica(servers, owner)
    feed = LiveFeed()
    await hub.subscribe(live, feed.push)
    kill(servers, owner)
    await take_over(replica)

    async def promoted() -> bool:
        return await slot_owner(servers, slot_of(live)) == replica

    await eventually(promoted, what="the replica to own the slot")
    assert await next_data(feed) == CATCH_UP  # subscribed again, on the new master
    assert await shard_subscribers(replica, live) == 1
    assert hub.connected.is_set()  # the dead master holds none of our channels now
    assert ("127.0.0.1", owner) not in hub.sharded._shards

    async def delivered() -> bool:  # the cluster client finds the new master too
        try:
            return await handle.publish(live, b"after failover") == 1
        except Exception:
            return False

    await eventually(delivered, what="a publish to the promoted replica")
    assert await next_data(feed) == b"after failover"
