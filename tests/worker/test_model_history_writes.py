"""A model-native session's model history reaches Redis append-only, in the fenced
publish calls (event_publish.lua against a real redis-server): only the bytes since the
last write go, a retried call writes the same bytes again, a fenced-out worker writes
nothing, and the history goes with the session's other keys at session.closed."""

import contextlib
import struct

from shared.contracts import ModelHistory
from shared.protocol.duplex import SessionClosed
from shared.redis.keys import KeySchema
from shared.redis.store import ModelAppend, PublishItem, SessionStore, SessionWrite
from tests.worker.publishing import Host, own, publisher_on


async def append(store: SessionStore, sid: str, model: ModelAppend, owner: int) -> list[int]:
    """A publish call with no events that appends `model`, fenced on `owner`."""
    replies = await store.publish_many(
        [SessionWrite(sid, [], owner_generation=owner, model_append=model)],
        max_bytes=1 << 20,
        ttl_ms=60_000,
        closed_ttl_ms=60_000,
    )
    return replies[sid]


def frames(first: int, count: int) -> list[bytes]:
    return [struct.pack("<I", n) for n in range(first, first + count)]


@contextlib.asynccontextmanager
async def writing(redis_client, sid: str):
    """A session opened in Redis and owned (generation 1) by a running publisher whose
    host gives it a 4-byte-record model history: (store, history, publisher)."""
    store = SessionStore(redis_client, KeySchema())
    await store.open(sid, "w-a", "frame_echo", "", "{}")
    host = Host()
    history = host.histories[sid] = ModelHistory(4)
    publisher = publisher_on(store, host)
    own(publisher, sid, 1)
    publisher.start()
    try:
        yield store, history, publisher
    finally:
        await publisher.stop()


async def test_only_the_new_frames_are_written_each_time(redis_client):
    keys = KeySchema()
    sid = "duplex-native-history"
    async with writing(redis_client, sid) as (store, history, publisher):
        for record in frames(1, 12):
            history.append(record)
        publisher.queue_model_writes()  # what the once-a-second loop does
        await publisher.flush()
        assert await redis_client.get(keys.model_history(sid)) == bytes(history.data)
        assert history.written == 48
        for record in frames(13, 13):
            history.append(record)
        publisher.queue_model_writes()
        await publisher.flush()
        assert await redis_client.get(keys.model_history(sid)) == bytes(history.data)
        assert publisher.model_bytes == 25 * 4  # each byte once: never the whole again
        meta = await store.meta(sid)
        assert (meta["model_bytes"], meta["model_record_bytes"]) == ("100", "4")
        publisher.queue_model_writes()  # nothing new: nothing queued
        await publisher.flush()
        assert publisher.model_bytes == 100
        state = await store.restore_state(sid)
        assert state.model_history == bytes(history.data)
        assert state.model_record_bytes == 4


async def test_a_history_that_lost_bytes_in_redis_is_written_again_from_where_it_ends(
    redis_client,
):
    """The key lost its bytes (a Redis failover without persistence, an operator's DEL):
    the next append finds a gap, writes nothing past it, and says where the history ends;
    the publisher writes the rest again from there, and Redis holds it all again."""
    keys = KeySchema()
    sid = "duplex-native-lost"
    async with writing(redis_client, sid) as (_, history, publisher):
        for record in frames(1, 10):
            history.append(record)
        publisher.queue_model_writes()
        await publisher.flush()
        await redis_client.delete(keys.model_history(sid))
        for record in frames(11, 5):
            history.append(record)
        publisher.queue_model_writes()
        await publisher.flush()  # the gap's round, then the round that writes it all again
        assert await redis_client.get(keys.model_history(sid)) == bytes(history.data)
        assert history.written == 60


async def test_a_retried_append_writes_the_same_bytes_and_a_gap_writes_nothing(redis_client):
    keys = KeySchema()
    store = SessionStore(redis_client, keys)
    sid = "duplex-native-retry"
    await store.open(sid, "w-a", "frame_echo", "", "{}")
    data = b"".join(frames(1, 5))
    for _ in range(2):  # the reply of the first was lost: the same call again
        await append(store, sid, ModelAppend(0, data, 4), owner=1)
    assert await redis_client.get(keys.model_history(sid)) == data
    # past the end: the key lost frames; the reply's last value is where it ends
    assert await append(store, sid, ModelAppend(400, b"late", 4), owner=1) == [len(data)]
    assert await redis_client.get(keys.model_history(sid)) == data
    assert (await store.meta(sid))["model_gap"] == "400"


async def test_a_fenced_out_worker_writes_no_history_and_a_close_removes_it(redis_client):
    keys = KeySchema()
    store = SessionStore(redis_client, keys)
    sid = "duplex-native-fenced"
    await store.open(sid, "w-a", "frame_echo", "", "{}")
    # not the session's owner generation (1)
    reply = await append(store, sid, ModelAppend(0, b"".join(frames(1, 3)), 4), owner=2)
    assert reply == [-2]
    assert not await redis_client.exists(keys.model_history(sid))
    await append(store, sid, ModelAppend(0, b"".join(frames(1, 3)), 4), owner=1)
    assert await redis_client.exists(keys.model_history(sid))
    closed = SessionClosed(session_id=sid, reason="client_closed")
    await store.publish(
        sid,
        [PublishItem(closed.to_json(), closed.wire_type)],
        max_bytes=1 << 20,
        ttl_ms=60_000,
        closed_ttl_ms=60_000,
        owner_generation=1,
    )
    assert not await redis_client.exists(keys.model_history(sid))
