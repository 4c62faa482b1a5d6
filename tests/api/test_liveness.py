"""A pod declared dead while it was only stalled takes its attached sessions back."""

import pytest

from services.api.liveness import PodLiveness
from shared.redis.keys import KeySchema
from shared.redis.store import PublishItem, SessionStore, token_digest

KEYS = KeySchema()


async def active_session(store: SessionStore, sid: str) -> None:
    await store.open(sid, "worker-a", "echo", token_digest("tok"), "{}", "api-a")
    created = PublishItem(b'{"type":"session.created"}', "session.created", False, b"{}")
    await store.publish(sid, [created], max_bytes=1 << 20, ttl_ms=60_000, closed_ttl_ms=60_000)


async def sweep(client, store: SessionStore, pod_id: str) -> None:
    """What sweep_dead_apis does to a pod whose heartbeat is too old."""
    for member in await client.smembers(KEYS.api_sessions(pod_id)):
        sid = member.decode()
        generation = int((await store.meta(sid))["attachment_generation"])
        await store.detach(sid, generation, 30_000, by="sweep")
    await client.delete(KEYS.api_sessions(pod_id))
    await client.zrem(KEYS.apis(), pod_id)


async def test_a_swept_pod_takes_back_what_it_still_holds_on_its_next_beat(redis_client):
    store = SessionStore(redis_client)
    liveness = PodLiveness(redis_client, KEYS, store, "api-a", interval_s=60, ttl_s=600)
    for sid in ("duplex-1", "duplex-2", "duplex-3"):
        await active_session(store, sid)
        await redis_client.sadd(KEYS.api_sessions("api-a"), sid)
    liveness.attach("duplex-1", 1)
    liveness.attach("duplex-2", 1)
    liveness.attach("duplex-3", 1)
    liveness.release("duplex-3", 1)  # its socket went away before the stall
    await liveness.beat()
    assert liveness.reclaims == 0  # the first beat registers, nothing to take back
    await sweep(redis_client, store, "api-a")
    assert {(await store.meta(s))["state"] for s in ("duplex-1", "duplex-2")} == {"detached"}

    await liveness.beat()  # the pod runs again

    assert liveness.reclaims == 1
    for sid in ("duplex-1", "duplex-2"):
        meta = await store.meta(sid)
        assert meta["state"] == "active" and meta["pod"] == "api-a"
        assert await redis_client.zscore(KEYS.leases(), sid) is None
    assert (await store.meta("duplex-3"))["state"] == "detached"  # released: grace goes on
    members = {m.decode() for m in await redis_client.smembers(KEYS.api_sessions("api-a"))}
    assert members == {"duplex-1", "duplex-2"}  # indexed again for the next sweep
    await liveness.beat()
    assert liveness.reclaims == 1  # registered again: an ordinary beat


async def test_a_session_resumed_elsewhere_meanwhile_is_not_taken_back(redis_client):
    store = SessionStore(redis_client)
    liveness = PodLiveness(redis_client, KEYS, store, "api-a", interval_s=60, ttl_s=600)
    await active_session(store, "duplex-1")
    await redis_client.sadd(KEYS.api_sessions("api-a"), "duplex-1")
    liveness.attach("duplex-1", 1)
    await liveness.beat()
    await sweep(redis_client, store, "api-a")
    await store.resume("duplex-1", "tok", "tok-2", 0, "api-b")  # the client moved on
    liveness.release("duplex-1", 2)  # not ours: a release of another generation is a no-op
    await liveness.beat()
    meta = await store.meta("duplex-1")
    assert meta["state"] == "active" and meta["pod"] == "api-b"
    assert meta["attachment_generation"] == "2"


async def test_a_reclaim_that_failed_is_tried_again_and_a_long_silence_reclaims(redis_client):
    store = SessionStore(redis_client)
    liveness = PodLiveness(redis_client, KEYS, store, "api-a", interval_s=60, ttl_s=600)
    await active_session(store, "duplex-1")
    await redis_client.sadd(KEYS.api_sessions("api-a"), "duplex-1")
    liveness.attach("duplex-1", 1)
    await liveness.beat()
    await sweep(redis_client, store, "api-a")
    real_touch = store.touch

    async def failing_touch(*args, **kwargs):
        raise ConnectionError("Redis went away mid-reclaim")

    store.touch = failing_touch
    with pytest.raises(ConnectionError):
        await liveness.beat()
    store.touch = real_touch
    await liveness.beat()  # registered again already (ZADD adds nothing): still reclaims
    assert (await store.meta("duplex-1"))["state"] == "active"
    # a sweep that detached the session but died before removing the pod: the pod only
    # sees that its last beat is older than the TTL
    generation = int((await store.meta("duplex-1"))["attachment_generation"])
    await store.detach("duplex-1", generation, 30_000, by="sweep")
    liveness.ttl_s = 0.0
    await liveness.beat()
    assert (await store.meta("duplex-1"))["state"] == "active"


async def test_a_session_its_own_socket_left_is_not_taken_back(redis_client):
    store = SessionStore(redis_client)
    liveness = PodLiveness(redis_client, KEYS, store, "api-a", interval_s=60, ttl_s=600)
    await active_session(store, "duplex-1")
    liveness.attach("duplex-1", 1)
    await liveness.beat()
    await redis_client.zrem(KEYS.apis(), "api-a")  # swept...
    await store.detach("duplex-1", 1, 30_000)  # ...while its client left (by="client")
    await liveness.beat()
    assert (await store.meta("duplex-1"))["state"] == "detached"  # its grace goes on
