"""Handing a drained session over (services/worker/handover.py) and leaving the registry
(services/worker/ownership.py `leave`), on a real redis-server, the 3-master Redis Cluster
and fakeredis: a target that left before it could read the restore entry is not where the
session ends up, a lost CAS reply is recognised, and a worker that still names sessions it
does not hold leaves them to the dead-worker sweep instead of deleting them."""

from __future__ import annotations

import types
import uuid

from services.worker import handover
from services.worker.ownership import Ownership
from shared.protocol.duplex import DuplexSessionCreated
from shared.redis.boundary import RestoreRequest, decode_entry
from shared.redis.keys import KeySchema
from shared.redis.store import PublishItem, SessionStore

KEYS = KeySchema(f"handover-{uuid.uuid4().hex[:6]}")


def worker_of(client, worker_id: str = "w-a") -> types.SimpleNamespace:
    """What the hand-over and `leave` read of a worker process."""
    return types.SimpleNamespace(
        worker_id=worker_id,
        keys=KEYS,
        inbox=KEYS.inbox(worker_id),
        store=SessionStore(client, KEYS),
        redis=types.SimpleNamespace(client=client),
    )


def leaving(worker: types.SimpleNamespace) -> Ownership:
    """The ownership checks of that worker; `leave` uses its store alone."""
    return Ownership(
        worker.worker_id,
        worker.store,
        None,  # type: ignore[arg-type]  # no sessions are held here
        None,  # type: ignore[arg-type]
        notify=None,  # type: ignore[arg-type]
        report_load=None,  # type: ignore[arg-type]
    )


async def opened(client, worker_id: str = "w-a") -> str:
    sid = f"duplex-{uuid.uuid4().hex[:12]}"
    store = SessionStore(client, KEYS)
    await store.open(sid, worker_id, "echo", "", "{}")
    created = DuplexSessionCreated(session={"id": sid})
    item = PublishItem(created.to_json(), created.wire_type, False, b"{}")
    journal = {"max_bytes": 1 << 20, "ttl_ms": 60_000, "closed_ttl_ms": 60_000}
    await store.publish(sid, [item], owner_generation=1, checkpoint=b'{"v":1}', **journal)
    await client.sadd(KEYS.worker_sessions(worker_id), sid)
    return sid


async def restores_in(client, worker_id: str) -> list[RestoreRequest]:
    entries = await client.xrange(KEYS.inbox(worker_id))
    return [message for _, fields in entries for message in decode_entry(fields)]


async def test_a_session_handed_to_a_worker_that_left_moves_on(redis_client):
    worker = worker_of(redis_client)
    sid = await opened(redis_client)
    await redis_client.zadd(KEYS.workers(), {"w-c": 10**13})  # w-b is not registered: gone
    notices = []

    async def notify(session_id, notice):
        notices.append(notice.to_bytes())

    async def pick(exclude):
        assert exclude == frozenset({"w-a", "w-b"})
        return "w-c"

    handed = await handover.hand_over(
        worker.store, worker.worker_id, sid, "w-b", 1, 123, notify, pick
    )
    assert handed == ("w-c", 3)
    meta = await worker.store.meta(sid)
    assert (meta["worker"], meta["owner_generation"], meta["moved_from"]) == ("w-c", "3", "w-b")
    assert await restores_in(redis_client, "w-c") == [RestoreRequest(sid, 3, "drain", "w-a")]
    assert notices == [b"!moved 2 w-b", b"!moved 3 w-c"]
    assert await redis_client.smembers(KEYS.worker_sessions("w-c")) == {sid.encode()}
    assert not await redis_client.smembers(KEYS.worker_sessions("w-b"))
    assert not await redis_client.smembers(KEYS.worker_sessions("w-a"))


async def test_a_move_whose_reply_was_lost_is_recognised_on_the_retry(redis_client):
    worker = worker_of(redis_client)
    sid = await opened(redis_client)
    move_owner = worker.store.move_owner
    calls = []

    async def lost_reply(*args, **kwargs):
        calls.append(args)
        result = await move_owner(*args, **kwargs)
        if len(calls) == 1:
            raise ConnectionError("the reply was lost")
        return result

    worker.store.move_owner = lost_reply
    generation = await handover._move_owner(worker.store, sid, "w-a", "w-b", 1, None)
    assert generation == 2 and len(calls) == 2


async def test_a_worker_leaving_with_a_session_it_never_took_leaves_it_to_the_sweep(
    redis_client,
):
    worker = worker_of(redis_client, "w-b")
    await redis_client.zadd(KEYS.workers(), {"w-b": 10**13})
    await redis_client.hset(KEYS.worker("w-b"), "model", "echo")
    sid = await opened(redis_client, "w-b")  # handed over here after the consume loop stopped
    await redis_client.zrem(KEYS.workers(), "w-b")  # stop() leaves the registry first
    await leaving(worker).leave()
    assert await redis_client.zscore(KEYS.workers(), "w-b") == 1  # dead for the sweep now
    assert await redis_client.smembers(KEYS.worker_sessions("w-b")) == {sid.encode()}
    # once nothing names it, it leaves for good
    await redis_client.hset(KEYS.session(sid), "worker", "w-c")
    await leaving(worker).leave()
    assert not await redis_client.exists(KEYS.worker("w-b"), KEYS.worker_sessions("w-b"))
