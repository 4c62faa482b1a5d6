"""The janitor's jobs (services/api/janitor.py), built from the parts it uses (no pod): an
expired lease is journaled and closed through the WorkerClient, a dead API pod's sessions
enter disconnect grace, a dead worker's sessions end with worker_lost, its events following
the session's surface (an openai-surface session's error goes out without
`server_event_seq`). Its ticks log at DEBUG only: an idle pod's log stays quiet."""

import asyncio
import logging
import time

import fakeredis
import orjson
import pytest

from services.api.inbox_writer import InboxWriter
from services.api.janitor import Janitor, quiet_arq
from services.api.live import LiveHub
from services.api.worker_client import WorkerClient
from shared.contracts import SessionRuntimeConfig
from shared.ids import EXPIRED_CLOSE_REASON
from shared.redis.boundary import CloseRequest
from shared.redis.connection import RedisHandle
from shared.redis.keys import KeySchema
from shared.redis.live_message import stamps_seq
from shared.redis.placement import WorkerDirectory
from shared.redis.store import PublishItem, SessionStore
from tests.api.parts import JOURNAL, KEYS, active_session, inbox, janitor_on, steady_since_long_ago


@pytest.fixture
async def janitor():
    server = fakeredis.FakeServer()
    client = fakeredis.FakeAsyncRedis(server=server)
    janitor, workers = janitor_on(
        RedisHandle(client, "fakeredis", server=server), live_client=client
    )
    steady_since_long_ago(janitor)
    yield janitor
    await workers.stop()
    await client.aclose()


async def journal_types(janitor, sid: str) -> list[str]:
    return [orjson.loads(data)["type"] for _, data in await janitor.store.journal(sid, 0)]


async def test_an_expired_lease_is_journaled_then_closed_on_its_worker(janitor):
    await active_session(janitor.store, "duplex-e", worker="w1")
    assert await janitor.store.detach("duplex-e", 1, grace_ms=0) == 1
    assert await janitor.expire_leases() == ["duplex-e"]
    assert await journal_types(janitor, "duplex-e") == ["session.expired"]
    [close] = await inbox(janitor.client, "w1")
    assert close == CloseRequest("duplex-e", EXPIRED_CLOSE_REASON, 0)
    assert await janitor.client.zscore(KEYS.leases(), "duplex-e") is None
    assert await janitor.expire_leases() == []  # claimed once


async def test_a_dead_api_pods_sessions_wait_for_a_resume(janitor):
    await active_session(janitor.store, "duplex-a")  # attached through api-t
    await janitor.client.sadd(KEYS.api_sessions("api-t"), "duplex-a")
    await janitor.client.zadd(KEYS.apis(), {"api-t": int((time.time() - 60) * 1000)})
    assert await janitor.sweep_dead_apis() == ["duplex-a"]
    meta = await janitor.store.meta("duplex-a")
    assert (meta["state"], meta["detached_by"]) == ("detached", "sweep")
    assert int(meta["lease_deadline"]) == int(meta["detached_at"]) + 30_000
    assert await janitor.client.zscore(KEYS.apis(), "api-t") is None
    assert await janitor.client.exists(KEYS.api_sessions("api-t")) == 0


async def test_a_dead_workers_sessions_end_with_worker_lost(janitor):
    await active_session(janitor.store, "duplex-w", worker="w9")
    await janitor.client.sadd(KEYS.worker_sessions("w9"), "duplex-w")
    await janitor.client.hset(KEYS.worker("w9"), mapping={"model": "echo"})
    await janitor.client.zadd(KEYS.workers(), {"w9": int((time.time() - 60) * 1000)})
    assert await janitor.sweep_dead_workers() == ["duplex-w"]
    assert await journal_types(janitor, "duplex-w") == ["error", "session.closed"]
    assert (await janitor.store.meta("duplex-w"))["state"] == "closed"
    assert await janitor.client.exists(KEYS.worker("w9"), KEYS.worker_sessions("w9")) == 0
    assert await janitor.client.zscore(KEYS.workers(), "w9") is None


async def test_after_an_outage_no_heartbeat_is_judged_until_redis_answered_for_a_ttl(janitor):
    """A failover: the promoted primary holds every worker's and pod's score from before
    the outage, all older than the TTL by the first tick after it. A janitor whose pod's
    beats have just started going through again (here: its first) judges none of them dead
    until they have gone through for a TTL, so the others have had a TTL to beat too."""
    from services.api.liveness import SteadyRedis

    janitor.steady = SteadyRedis(5.0)
    janitor.steady.tick()  # the pod's first beat after the outage
    await active_session(janitor.store, "duplex-w", worker="w9")
    await janitor.client.sadd(KEYS.worker_sessions("w9"), "duplex-w")
    await janitor.client.hset(KEYS.worker("w9"), mapping={"model": "echo"})
    stale = int((time.time() - 6) * 1000)  # beat 6 s ago, just before the outage
    await janitor.client.zadd(KEYS.workers(), {"w9": stale})
    await janitor.client.zadd(KEYS.apis(), {"api-t": stale})
    assert await janitor.sweep_dead_workers() == []
    assert await janitor.sweep_dead_apis() == []
    assert janitor.steady.waited == 2
    assert await janitor.client.zscore(KEYS.workers(), "w9") is not None
    assert (await janitor.store.meta("duplex-w"))["state"] == "active"


def test_steady_redis_counts_from_the_first_tick_after_a_gap():
    from services.api.liveness import SteadyRedis

    steady = SteadyRedis(5.0, gap_s=3.0)
    # a beat a second: not steady until 5 s of them
    judged = []
    for t in (100, 101, 102, 103, 104, 105):
        steady.tick(now=t)
        judged.append(steady.judging(now=t))
    assert judged == [False, False, False, False, False, True]
    # an outage: no beat for 8 s; judging stops at once (no beat within the gap), and the
    # count starts again from the first beat after it
    assert steady.judging(now=109) is False
    steady.tick(now=113)
    assert steady.judging(now=113) is False
    for t in (114, 115, 116, 117):
        steady.tick(now=t)
    assert steady.judging(now=117) is False and steady.judging(now=118.5) is True
    # beats 2.5 s apart (a slow pod) are no outage
    steady.tick(now=119.5)
    assert steady.judging(now=119.5) is True


async def test_the_pods_heartbeat_is_the_clock_its_janitor_judges_by(janitor):
    """Each sweep tick runs on one pod of many: the clock it judges by is its pod's
    heartbeat (every second on every pod), not its own ticks, which a pod running one
    sweep in four would see as gaps and never judge (a review measured 19% of ticks judged
    with 4 pods)."""
    from services.api.liveness import PodLiveness

    liveness = PodLiveness(janitor.client, KEYS, janitor.store, "api-t", 1.0, 0.0)
    swept, workers = janitor_on(janitor.redis, live_client=janitor.client, steady=liveness.steady)
    try:
        await active_session(swept.store, "duplex-w", worker="w9")
        await swept.client.sadd(KEYS.worker_sessions("w9"), "duplex-w")
        await swept.client.hset(KEYS.worker("w9"), mapping={"model": "echo"})
        await swept.client.zadd(KEYS.workers(), {"w9": int((time.time() - 60) * 1000)})
        for _ in range(3):  # its own sweeps do not tick the pod's clock
            assert await swept.sweep_dead_workers() == []
        await liveness.beat()  # the pod's heartbeat went through (a TTL of 0 here)
        assert await swept.sweep_dead_workers() == ["duplex-w"]
    finally:
        await workers.stop()


def test_the_surface_is_read_from_the_config_in_the_hash():
    assert not stamps_seq({"config": '{"model":"echo","duplex_surface":"openai"}'})
    for surface in ("moshi", "live"):
        config = orjson.dumps({"model": "echo", "duplex_surface": surface}).decode()
        assert not stamps_seq({"config": config})
    assert stamps_seq({"config": '{"model":"echo"}'})
    assert stamps_seq({"config": '{"model":"echo","duplex_surface":"duplex"}'})
    assert stamps_seq({"config": "not json"}) and stamps_seq({})


@pytest.mark.parametrize(
    "config, seq_in_json", [("{}", True), ('{"duplex_surface":"openai"}', False)]
)
async def test_a_lost_sessions_error_follows_its_surface(janitor, config, seq_in_json):
    sid = "duplex-lost"
    await janitor.store.open(sid, "w-dead", "echo", "", config)
    created = PublishItem(b'{"type":"session.created"}', "session.created", False, b"{}")
    await janitor.store.publish(sid, [created], **JOURNAL)
    assert await janitor._close_lost("w-dead", sid, await janitor.store.meta(sid))
    records = await janitor.store.journal_records(sid, 0)
    assert [r.wire_type for r in records] == ["error", "session.closed"]
    assert [r.seq for r in records] == [1, 2]
    assert [("server_event_seq" in orjson.loads(r.data)) for r in records] == [seq_in_json] * 2


def sweeps_done(caplog, prefix: str = KEYS.prefix) -> list[logging.LogRecord]:
    """arq's record of each finished dead-worker sweep of the janitor of `prefix`
    ("0.00s ← duplex:sweep_dead_workers ● []")."""
    return [
        r
        for r in caplog.records
        if r.name == "arq.worker" and f"← {prefix}:sweep_dead_workers " in r.getMessage()
    ]


async def test_two_deployments_on_one_redis_each_run_their_own_sweeps(janitor):
    """A cron job's id is its name and its second, whatever its queue: with the same names,
    two janitors of different key prefixes on one Redis took each other's ticks, and one
    of them swept nothing (a dead worker of its deployment stayed unnoticed)."""
    other_keys = KeySchema("other")
    client = janitor.client
    store = SessionStore(client, other_keys)
    other = Janitor(
        janitor.redis,
        other_keys,
        store,
        WorkerClient(InboxWriter(client, other_keys, store.scripts)),
        SessionRuntimeConfig(),
        heartbeat_ttl_s=5.0,
        disconnect_grace_s=30.0,
        directory=WorkerDirectory(client, other_keys, heartbeat_ttl_s=5.0),
        live=LiveHub(client, other_keys.api("api-o")),
    )
    steady_since_long_ago(other)
    sweeps = {janitor: 0, other: 0}
    job_ids: dict[Janitor, set[str]] = {janitor: set(), other: set()}
    for each in sweeps:
        real = each.sweep_dead_workers

        async def counted(ctx=None, real=real, each=each) -> list[str]:
            sweeps[each] += 1
            job_ids[each].add(ctx["job_id"])
            return await real(ctx)

        counted.__name__ = "sweep_dead_workers"
        each.sweep_dead_workers = counted  # type: ignore[method-assign]
    await janitor.start()
    await other.start()
    try:
        async with asyncio.timeout(60):
            while max(sweeps.values()) < 6:
                await asyncio.sleep(0.05)
    finally:
        await other.stop()
        await janitor.stop()
    # each deployment's ticks are its own: no job id is both's (the same id is one job,
    # which only one of them runs)
    assert all(i.startswith(f"{KEYS.prefix}:") for i in job_ids[janitor]), job_ids
    assert all(i.startswith("other:") for i in job_ids[other]), job_ids
    assert min(sweeps.values()) >= 5, sweeps


async def test_ticks_log_at_debug_and_nothing_at_info(janitor, caplog):
    """arq logs each run of each job: six INFO lines a second on an idle pod buried
    everything else (issue 26). Three ticks of the real arq worker log only at DEBUG."""
    caplog.set_level(logging.DEBUG)
    await janitor.start()
    try:
        async with asyncio.timeout(60):
            while len(sweeps_done(caplog)) < 3:
                await asyncio.sleep(0.05)
    finally:
        await janitor.stop()
    assert {r.levelname for r in sweeps_done(caplog)} == {"DEBUG"}
    loud = [
        (r.name, r.levelname, r.getMessage())
        for r in caplog.records
        if r.levelno >= logging.INFO and r.name.startswith(("arq", "services.api"))
    ]
    assert loud == []


def test_arqs_routine_lines_are_debug_its_failures_keep_their_level(caplog):
    quiet_arq()
    quiet_arq()  # once, however many janitors start
    arq_log = logging.getLogger("arq.worker")
    assert len(arq_log.filters) == 1
    with caplog.at_level(logging.INFO):
        arq_log.info("%6.2fs → %s()", 0.2, "expire_leases")
        arq_log.warning("job %s expired", "j1")
        arq_log.error("job %s failed", "j2")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "job j1 expired"),
        ("ERROR", "job j2 failed"),
    ]
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        arq_log.info("shutdown on %s", "SIGUSR1")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("DEBUG", "shutdown on SIGUSR1")
    ]
