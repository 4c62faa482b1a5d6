"""A worker's inbox stripes: one stream per Redis Cluster master, each session's messages on
the stripe of its own keys' master, in every process alike (shared/redis/inbox_stripes.py)."""

from __future__ import annotations

import uuid

import pytest
from redis.crc import key_slot

from services.api.inbox_writer import InboxWriter
from shared.protocol.duplex import Heartbeat
from shared.redis.boundary import CommandRecord, OpenRequest, decode_entry
from shared.redis.connection import connect
from shared.redis.inbox_stripes import (
    ANNOUNCED_TTL_S,
    InboxStripes,
    StripeDirectory,
    announce,
    choose_stripes,
    create_groups,
    delete_worker_keys,
)
from shared.redis.keys import INBOX_GROUP, KeySchema
from shared.redis.store import SessionStore


def keys() -> KeySchema:
    return KeySchema(f"stripes-{uuid.uuid4().hex[:6]}")


def test_a_slot_goes_to_the_stripe_whose_ranges_hold_it():
    stripes = InboxStripes(((0, 99, 0), (100, 199, 4), (300, 16383, 9)))
    assert stripes.stripes == (0, 4, 9)
    assert [stripes.for_slot(s) for s in (0, 99, 100, 199, 300, 16383)] == [0, 0, 4, 4, 9, 9]
    assert stripes.for_slot(250) == 0  # no stripe lists it (resharded since): stripe 0
    assert InboxStripes.from_json(stripes.to_json()) == stripes
    # one Redis: one stripe, and no ranges to announce
    assert InboxStripes().stripes == (0,)
    assert InboxStripes().for_session(KeySchema(), "duplex-x") == 0
    assert InboxStripes.from_json(None) == InboxStripes.from_json(b"{}") == InboxStripes()
    with pytest.raises(ValueError):
        InboxStripes.from_json(b"[1]")


def test_stripe_0_is_the_workers_own_tag_and_the_others_have_tags_of_their_own():
    schema = KeySchema()
    assert schema.inbox("w-1") == "duplex:worker:{w-1}:inbox"
    assert schema.inbox("w-1", 0) == schema.inbox("w-1")
    assert schema.inbox("w-1", 7) == "duplex:worker:{w-1:s7}:inbox"
    assert schema.inbox_bytes("w-1", 7) == "duplex:worker:{w-1:s7}:inbox_bytes"


async def test_one_redis_has_one_stripe(redis_server):
    client = connect(redis_server.url).client
    try:
        assert await choose_stripes(client, keys(), "w-1") == InboxStripes()
    finally:
        await client.aclose()


@pytest.fixture
async def cluster(redis_cluster):
    """A client of the tests' cluster, and a key prefix of the test's own."""
    handle = connect(redis_cluster.url)
    yield handle.client, keys()
    await handle.close()


async def test_a_cluster_worker_has_a_stripe_on_every_master(cluster):
    client, schema = cluster
    stripes = await choose_stripes(client, schema, "w-1")
    masters = {node.name for node in client.get_primaries()}
    assert len(stripes.stripes) == len(masters) == 3
    # stripe 0 is where the worker's own keys are; each stripe's stream is on a master
    # of its own, and serves exactly that master's slots
    own = client.get_node_from_key(schema.worker("w-1")).name
    assert client.get_node_from_key(schema.inbox("w-1", 0)).name == own
    homes = {client.get_node_from_key(schema.inbox("w-1", k)).name for k in stripes.stripes}
    assert homes == masters
    for first, last, stripe in stripes.ranges:
        home = client.get_node_from_key(schema.inbox("w-1", stripe)).name
        for slot in (first, last):
            assert client.nodes_manager.get_node_from_slot(slot).name == home
    # a session's stripe shares its master with the session's own keys
    for n in range(30):
        sid = f"duplex-{n}"
        stripe = stripes.for_session(schema, sid)
        assert (
            client.get_node_from_key(schema.inbox("w-1", stripe)).name
            == client.get_node_from_key(schema.session(sid)).name
        )
    # the same choice for the same cluster, in any process
    assert await choose_stripes(client, schema, "w-1") == stripes


async def test_messages_reach_the_stripe_of_their_session_in_order(cluster):
    """The pod's writer, the store's entries (a restore, forwarded messages) and the
    directory agree: each session's messages are in its stripe, in the order written."""
    client, schema = cluster
    writer = InboxWriter(client, schema)
    try:
        stripes = await announce(client, schema, "w-1")
        await client.hset(schema.worker("w-1"), "model", "echo")
        await create_groups(client, schema, "w-1", stripes)
        sessions = [f"duplex-{n}" for n in range(12)]
        expected: dict[int, list[tuple[str, int]]] = {k: [] for k in stripes.stripes}
        for seq in range(1, 4):
            for sid in sessions:
                message = CommandRecord(sid, 1, seq, Heartbeat(event_id=f"h{seq}"))
                await writer.send("w-1", message)
                expected[stripes.for_session(schema, sid)].append((sid, seq))
        store = SessionStore(client, schema)
        await store.inbox_append(
            "w-1", OpenRequest(sessions[0], {}).to_fields(), session_id=sessions[0]
        )
        expected[stripes.for_session(schema, sessions[0])].append((sessions[0], 0))
        for stripe in stripes.stripes:
            read = [
                (m.session_id, m.seq if isinstance(m, CommandRecord) else 0)
                for _, fields in await client.xrange(schema.inbox("w-1", stripe))
                for m in decode_entry(fields)
            ]
            assert read == expected[stripe], stripe
        assert all(expected.values())  # twelve sessions spread over the three masters
        # every stripe has its group, and goes with the worker's other keys
        for stripe in stripes.stripes:
            groups = await client.xinfo_groups(schema.inbox("w-1", stripe))
            assert [g["name"] for g in groups] == [INBOX_GROUP.encode()]
        await delete_worker_keys(client, schema, "w-1", stripes)
        for stripe in stripes.stripes:
            assert not await client.exists(schema.inbox("w-1", stripe))
        assert not await client.exists(schema.worker("w-1"))
        # the announcement stays: the id's stripes never change
        assert await announce(client, schema, "w-1") == stripes
    finally:
        await writer.stop()


async def test_an_ids_announcement_stands_for_every_process_under_it(cluster):
    """A worker restarted under the same id, whatever the cluster looks like then (a
    reshard), takes the stripes its id announced: the processes that read them once keep
    writing where they are read."""
    client, schema = cluster
    first = InboxStripes(((0, 16383, 0),))  # as if chosen on another cluster layout
    key = schema.inbox_stripes("w-3")
    assert await client.set(key, first.to_json(), nx=True, ex=60)
    assert await announce(client, schema, "w-3") == first  # not chosen again
    assert ANNOUNCED_TTL_S - 5 <= await client.ttl(key) <= ANNOUNCED_TTL_S  # and renewed
    # two processes under one new id at once: the first SET NX stands for both
    both = [await announce(client, schema, "w-4"), await announce(client, schema, "w-4")]
    assert both[0] == both[1] == await choose_stripes(client, schema, "w-4")


async def test_the_directory_reads_an_announcement_once_and_keeps_it(cluster):
    client, schema = cluster
    stripes = await announce(client, schema, "w-2")
    directory = StripeDirectory(client, schema)
    assert directory.known("w-2") is None
    assert await directory.of("w-2") == stripes
    # read once: a session's messages never change streams half-way
    await client.delete(schema.inbox_stripes("w-2"))
    assert await directory.of("w-2") == stripes
    sid = "duplex-dir"
    stripe = stripes.for_session(schema, sid)
    assert await directory.inbox_of("w-2", sid) == (
        schema.inbox("w-2", stripe),
        schema.inbox_bytes("w-2", stripe),
        stripe,
    )
    # a cluster worker with no announcement (not made yet, or lost): stripe 0, asked again
    assert await directory.of("w-none") == InboxStripes()
    assert directory.known("w-none") is None
    # one that does not decode: stripe 0, which the worker always reads, and said once
    await client.set(schema.inbox_stripes("w-bad"), b"[1]")
    assert await directory.of("w-bad") == InboxStripes()
    assert directory.known("w-bad") == InboxStripes()


async def test_on_one_redis_a_worker_has_one_stripe_and_announces_nothing(redis_server):
    handle = connect(redis_server.url)
    schema = keys()
    try:
        assert await announce(handle.client, schema, "w-1") == InboxStripes()
        assert not await handle.client.exists(schema.inbox_stripes("w-1"))
        directory = StripeDirectory(handle.client, schema)
        assert await directory.of("w-1") == InboxStripes()
        assert directory.known("w-1") == InboxStripes()  # no Redis command next time
    finally:
        await handle.close()


def test_stripe_tags_hash_apart():
    """The tags differ, so the slots may: what lets a stripe land on another master."""
    schema = KeySchema()
    slots = {key_slot(schema.inbox("w-1", k).encode()) for k in range(20)}
    assert len(slots) > 10
