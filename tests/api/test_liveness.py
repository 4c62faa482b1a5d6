"""A pod declared dead while it was only stalled takes its attached sessions back."""

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
        await store.detach(sid, int((await store.meta(sid))["attachment_generation"]), 30_000)
    await client.delete(KEYS.api_sessions(pod_id))
    await client.zrem(KEYS.apis(), pod_id)


async def test_a_swept_pod_takes_back_what_it_still_holds_on_its_next_beat(redis_client):
    store = SessionStore(redis_client)
    liveness = PodLiveness(redis_client, KEYS, store, "api-a", interval_s=60)
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
    liveness = PodLiveness(redis_client, KEYS, store, "api-a", interval_s=60)
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
