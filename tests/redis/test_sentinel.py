"""Our Redis code through Redis Sentinel (harness/redis_sentinel.py: a primary, its replica and
three sentinels) on a `redis+sentinel://` URL, as a pod given that DUPLEX_REDIS_URL connects:
the Lua-script store opens a session and publishes a worker's round through the
Sentinel-managed client; after the primary is SIGKILLed and the sentinels promote the
replica, the same client writes and reads again, and what was replicated before the kill is
there; the API pod's janitor (arq cron) sweeps an expired lease before and after the
failover.

The tests that kill the primary get a set of their own (`sentinel_set`); the kill-to-recovery
figures are printed (`pytest -s` shows them), never asserted."""

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import redis.asyncio as redis_async
from redis import exceptions as redis_errors

from harness.redis_sentinel import RedisSentinelSet
from services.api.janitor import Janitor
from shared.ids import EXPIRED_CLOSE_REASON
from shared.redis.boundary import CloseRequest
from shared.redis.connection import RedisHandle, connect
from shared.redis.store import SessionWrite
from tests.api.parts import active_session, inbox, janitor_on
from tests.redis.cluster_ops import eventually
from tests.redis.live_listen import LiveListener
from tests.redis.test_scripts import KEYS, event, opened

JOURNAL = {"max_bytes": 1 << 20, "ttl_ms": 60_000, "closed_ttl_ms": 5_000}
#: how a lost primary fails a command: the connection refused or dropped, a connect that
#: timed out, no primary named yet (MasterNotFoundError), the demoted one's READONLY (which
#: redis-py's Sentinel connection turns into a ConnectionError)
LOST_PRIMARY = (redis_errors.ConnectionError, redis_errors.TimeoutError)
#: generous: a 2-core machine under load stretches Sentinel's seconds
RECOVERY_TIMEOUT_S = 60.0


async def until_it_works(
    call: Callable[[], Awaitable[Any]], timeout_s: float = RECOVERY_TIMEOUT_S
) -> tuple[Any, Counter[str]]:
    """`await call()` again and again while the primary is lost (see `LOST_PRIMARY`); its
    result and the failures it met, by kind."""
    failures: Counter[str] = Counter()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call(), failures
        except LOST_PRIMARY as exc:
            failures[type(exc).__name__] += 1
            assert time.monotonic() < deadline, f"still failing after {timeout_s} s: {failures}"
            await asyncio.sleep(0.05)


async def close(handle: RedisHandle) -> None:
    """Close the handle (its client, and its connections to the sentinels)."""
    await handle.close()


def direct(port: int) -> redis_async.Redis:
    return redis_async.Redis(host="127.0.0.1", port=port)


async def promotion(sentinels: RedisSentinelSet, old_port: int) -> tuple[int, float]:
    """The promoted primary's port, and when (monotonic) every sentinel named it."""

    def wait() -> tuple[int, float]:
        port = sentinels.wait_promoted(old_port, RECOVERY_TIMEOUT_S)
        return port, time.monotonic()

    return await asyncio.to_thread(wait)


async def test_the_store_opens_and_publishes_a_round_through_sentinel(redis_sentinel):
    handle = connect(redis_sentinel.url)
    assert handle.sentinel is not None and not handle.cluster
    client = handle.client
    sid = f"duplex-{uuid.uuid4().hex}"
    replica = direct(redis_sentinel.replica_port())
    try:
        async with LiveListener(client, KEYS.live(sid)) as listener:
            store = await opened(client, sid=sid)
            # the worker's round: publish_many, fenced on the owner, with a checkpoint
            write = SessionWrite(
                sid, [event("a", 1), event("b", 2)], owner_generation=1, checkpoint=b'{"v":1}'
            )
            assert await store.publish_many([write], **JOURNAL) == {sid: [1, 2]}
            live = await listener.records(3)
        assert [r.seq for r in live] == [0, 1, 2]  # session.created is unsequenced
        journal = await store.journal(sid, 0)
        assert [orjson.loads(data)["n"] for _, data in journal] == [1, 2]
        assert await store.checkpoint(sid) == b'{"v":1}'
        meta = await store.meta(sid)
        assert (meta["state"], meta["next_seq"]) == ("active", "2")

        # what the scripts wrote reached the replica (what a failover would promote)
        async def replicated() -> bool:
            return await replica.hget(KEYS.session(sid), "next_seq") == b"2"

        await eventually(replicated, what="the round on the replica")
        assert await replica.get(KEYS.checkpoint(sid)) == b'{"v":1}'
    finally:
        await replica.aclose()
        await close(handle)


async def test_the_client_follows_the_primary_across_a_failover(sentinel_set):
    handle = connect(sentinel_set.url)
    client = handle.client
    try:
        async with client.pipeline(transaction=False) as pipe:
            # WAIT in the same pipeline: it counts the replicas that have this connection's
            # writes, so the replica holds the key before the kill
            pipe.set("before", "kept").wait(1, 1000)
            _, acked = await pipe.execute()
        assert acked == 1
        old = await asyncio.to_thread(sentinel_set.kill_primary)
        killed = time.monotonic()
        promoted = asyncio.create_task(promotion(sentinel_set, old))
        # the client tries from the kill on, as the pods do: its connection to the dead
        # primary fails first, then no primary is named until the sentinels agree
        _, failures = await until_it_works(lambda: client.set("after", "written"))
        wrote_s = time.monotonic() - killed
        new, named_at = await promoted
        assert new != old
        assert await client.mget("before", "after") == [b"kept", b"written"]
        server = direct(new)
        try:
            assert (await server.execute_command("ROLE"))[0] == b"master"
            assert await server.mget("before", "after") == [b"kept", b"written"]
        finally:
            await server.aclose()
        print(
            f"\nsentinel failover: kill -> every sentinel names {new}: {named_at - killed:.2f} s;"
            f" kill -> the client's write landed: {wrote_s:.2f} s,"
            f" after {sum(failures.values())} failed tries {dict(failures)}"
        )
    finally:
        await close(handle)


async def lease_expires(janitor: Janitor, sid: str, worker: str) -> float:
    """A session detached with no grace: the janitor's next tick journals its expiry and
    closes it on its worker. Returns how long that took (seconds)."""
    await active_session(janitor.store, sid, worker=worker)
    assert await janitor.store.detach(sid, 1, grace_ms=0) == 1
    detached = time.monotonic()

    async def closed_on_its_worker() -> bool:
        return len(await inbox(janitor.client, worker)) == 1

    await eventually(closed_on_its_worker, RECOVERY_TIMEOUT_S, f"the janitor to expire {sid}")
    assert await inbox(janitor.client, worker) == [CloseRequest(sid, EXPIRED_CLOSE_REASON, 0)]
    journal = await janitor.store.journal(sid, 0)
    assert [orjson.loads(data)["type"] for _, data in journal] == ["session.expired"]
    assert await janitor.client.zscore(janitor.keys.leases(), sid) is None
    return time.monotonic() - detached


async def test_the_janitor_runs_through_sentinel(sentinel_set):
    handle = connect(sentinel_set.url)
    janitor, workers = janitor_on(handle)
    await janitor.start()
    try:
        await lease_expires(janitor, "duplex-before", "w-before")
        old = await asyncio.to_thread(sentinel_set.kill_primary)
        killed = time.monotonic()
        new, named_at = await promotion(sentinel_set, old)
        assert new != old
        # the test's own client first finds the new primary (its first tries may fail)
        await until_it_works(lambda: handle.client.set("probe", "1"))
        swept_s = await lease_expires(janitor, "duplex-after", "w-after")
        print(
            f"\njanitor through a sentinel failover: kill -> promoted {named_at - killed:.2f} s;"
            f" a lease detached after it expired {swept_s:.2f} s later"
        )
    finally:
        await janitor.stop()
        await workers.stop()
        await close(handle)
