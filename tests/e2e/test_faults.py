"""Scale-out and faults with real processes: placement, dead workers and pods, Redis, drain.

Heartbeats are fast here (0.2 s, TTL 2 s) so faults are detected in about
three seconds; the janitor ticks every second. (A TTL much shorter than that
risks declaring a worker dead while a busy 2-core machine delays its beat.)
"""

import asyncio
import time
import uuid

import httpx
import orjson
import pytest
import redis.asyncio as redis_async
import websockets

from harness.processes import start_api, start_worker
from harness.redis_server import RedisServer
from harness.sessions import sine
from shared.client.duplex_client import DuplexClient, realtime_url
from shared.protocol.duplex import float_to_pcm16
from shared.redis.keys import KeySchema
from shared.redis.live_message import journal_entry_records
from shared.ring import load_bound

FAST = {
    "DUPLEX_HEARTBEAT_INTERVAL_S": "0.2",
    "DUPLEX_HEARTBEAT_TTL_S": "2.0",
    "DUPLEX_DISCONNECT_GRACE_S": "1.0",
}
TTL_S = 2.0


class Fleet:
    def __init__(self, redis_url: str, workers: dict[str, int], apis: int) -> None:
        self.redis_url = redis_url
        self.prefix = f"faults-{uuid.uuid4().hex[:6]}"
        self.keys = KeySchema(self.prefix)
        self.workers = {
            name: start_worker(
                redis_url, self.prefix, name, DUPLEX_MAX_SESSIONS=str(capacity), **FAST
            )
            for name, capacity in workers.items()
        }
        self.apis = [start_api(redis_url, self.prefix, f"api-{i}", **FAST) for i in range(apis)]
        for api in self.apis:
            api.wait_ready()
        self.client = redis_async.Redis.from_url(redis_url)

    async def wait_workers(self, count: int) -> None:
        for _ in range(200):
            if await self.client.zcard(self.keys.workers()) >= count:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("workers did not register")

    async def loads(self) -> dict[str, int]:
        return {
            name: int(await self.client.hget(self.keys.worker(name), "active") or 0)
            for name in self.workers
        }

    async def close(self) -> None:
        for process in [*self.apis, *self.workers.values()]:
            process.stop()
        await self.client.aclose()


@pytest.fixture
async def fleet_factory(redis_server):
    fleets = []

    def make(workers: dict[str, int], apis: int = 2) -> Fleet:
        fleet = Fleet(redis_server.url, workers, apis)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        await fleet.close()


async def open_raw(base: str) -> tuple[websockets.ClientConnection, dict]:
    ws = await websockets.connect(realtime_url(base))
    await ws.send('{"type":"session.update","session":{"extra_body":{"pace":0}}}')
    return ws, orjson.loads(await ws.recv())


async def test_200_sessions_spread_within_the_bound_and_the_201st_is_refused(fleet_factory):
    fleet = fleet_factory({"w-a": 67, "w-b": 67, "w-c": 66})
    await fleet.wait_workers(3)
    sockets = []
    try:
        for index in range(200):
            ws, created = await open_raw(fleet.apis[index % 2].base)
            assert created["type"] == "session.created", created
            sockets.append(ws)
        for _ in range(100):  # workers report their load just after admitting
            loads = await fleet.loads()
            if sum(loads.values()) == 200:
                break
            await asyncio.sleep(0.02)
        assert sum(loads.values()) == 200
        assert loads["w-a"] <= 67 and loads["w-b"] <= 67 and loads["w-c"] <= 66
        assert max(loads.values()) <= load_bound(199, 3)
        ws, refused = await open_raw(fleet.apis[0].base)
        sockets.append(ws)
        assert refused["type"] == "error" and refused["error"]["code"] == "resource_exhausted"
        assert refused["error"]["retryable"] is True
    finally:
        await asyncio.gather(*(ws.close() for ws in sockets))


async def test_a_killed_workers_sessions_get_worker_lost_and_others_finish(fleet_factory):
    fleet = fleet_factory({"w-doomed": 1, "w-ok": 1})
    await fleet.wait_workers(2)
    clients = [DuplexClient([fleet.apis[0].base], heartbeat_s=None) for _ in range(2)]
    for client in clients:
        await client.connect({"extra_body": {"pace": 1}})
    by_worker = {}
    for client in clients:
        meta = await fleet.client.hget(fleet.keys.session(client.session_id), "worker")
        by_worker[meta.decode()] = client
    doomed, healthy = by_worker["w-doomed"], by_worker["w-ok"]
    pcm = float_to_pcm16(sine(16000, 1.0))
    try:
        for client in (doomed, healthy):
            for i in range(0, len(pcm), 640):
                await client.append_audio(pcm[i : i + 640])
            await client.send({"type": "input.commit"})
            await client.until("response.output_audio.delta")
        fleet.workers["w-doomed"].kill()
        killed_at = time.monotonic()
        events = await doomed.until("session.closed", timeout=10)
        detected_s = time.monotonic() - killed_at
        error = next(e for e in events if e.wire_type == "error")
        assert error.code == "worker_lost" and error.retryable is True
        assert events[-1].reason == "worker_lost"
        assert (
            detected_s < TTL_S + 1.0 + 3.0
        )  # heartbeat TTL + a janitor tick (+ slack for a busy machine)
        healthy_events = await healthy.until("rate_limits.updated", timeout=20)
        assert healthy_events[-2].response["status"] == "completed"
        for _ in range(100):  # the sweep removes the registration right after publishing
            if not await fleet.client.exists(fleet.keys.worker("w-doomed")):
                break
            await asyncio.sleep(0.05)
        assert await fleet.client.exists(fleet.keys.worker("w-doomed")) == 0
    finally:
        for client in clients:
            await client.close(end_session=False)


async def test_sessions_of_a_killed_api_pod_expire_after_the_grace_and_free_their_slots(
    fleet_factory,
):
    fleet = fleet_factory({"w-1": 4}, apis=2)
    await fleet.wait_workers(1)
    victim, other = fleet.apis
    ws, created = await open_raw(victim.base)
    session_id = created["session"]["id"]
    for _ in range(100):  # the worker reports its load just after it admits the session
        if (await fleet.loads())["w-1"] == 1:
            break
        await asyncio.sleep(0.02)
    assert (await fleet.loads())["w-1"] == 1
    victim.kill()  # its client never reconnects
    # the worker frees the slot (load 0) before it publishes session.closed, which marks
    # the session closed (a client that sees the closure can open a replacement at once):
    # wait for all three
    for _ in range(200):
        entries = await fleet.client.xrange(fleet.keys.events(session_id))
        journal = [record for entry in entries for record in journal_entry_records(*entry)]
        kinds = [record.wire_type for record in journal]
        meta = await fleet.client.hgetall(fleet.keys.session(session_id))
        if (
            "session.expired" in kinds
            and (await fleet.loads())["w-1"] == 0
            and meta.get(b"state") == b"closed"
        ):
            break
        await asyncio.sleep(0.1)
    assert "session.expired" in kinds
    expired = next(orjson.loads(r.data) for r in journal if r.wire_type == "session.expired")
    assert expired["reason"] == "disconnect_grace_expired"
    assert (await fleet.loads())["w-1"] == 0  # the worker's slot is free again
    assert meta[b"state"] == b"closed"
    await ws.close()
    assert httpx.get(f"{other.base}/health/ready").status_code == 200


async def test_sigterm_on_an_api_pod_sends_clients_to_another_pod_without_loss(fleet_factory):
    fleet = fleet_factory({"w-1": 4}, apis=2)
    await fleet.wait_workers(1)
    leaving, staying = fleet.apis
    client = DuplexClient([leaving.base, staying.base], heartbeat_s=None)
    await client.connect({"extra_body": {"pace": 1}})
    try:
        pcm = float_to_pcm16(sine(16000, 1.0))
        for i in range(0, len(pcm), 640):
            await client.append_audio(pcm[i : i + 640])
        await client.send({"type": "input.commit"})
        await client.until("response.output_audio.delta")
        closing = asyncio.get_running_loop().run_in_executor(None, leaving.stop)
        events = await client.until("rate_limits.updated", timeout=30)
        assert await closing == 0
        assert client.close_codes[0] == 1012  # "service restart": reconnect and resume
        assert client.resumes == 1 and client.wire_seqs == list(range(1, client.last_seq + 1))
        assert next(
            e for e in events if e.wire_type == "response.output_audio_transcript.done"
        ).transcript == ("echo 1000 ms")
    finally:
        await client.close()


async def readiness_becomes(http: httpx.AsyncClient, api, status: int) -> bool:
    for _ in range(200):
        if (await http.get(f"{api.base}/health/ready")).status_code == status:
            return True
        await asyncio.sleep(0.05)  # polling the observable state, not ordering by time
    return False


async def test_pods_recover_when_redis_restarts():
    server = RedisServer()
    fleet = Fleet(server.url, {"w-1": 4}, apis=1)
    api = fleet.apis[0]
    try:
        await fleet.wait_workers(1)
        connected = DuplexClient([api.base], heartbeat_s=None)
        await connected.connect({"extra_body": {"pace": 0}})
        server.kill()  # Redis is down now: the process has exited
        await connected.send({"type": "session.heartbeat", "event_id": "while-down"})
        error = (await connected.until("error", timeout=10))[-1]
        assert (error.code, error.error_type, error.related_event_id) == (
            "internal_error",
            "server_error",
            "while-down",
        )
        assert error.extra.get("retryable", error.retryable) is True  # the socket stays open
        async with httpx.AsyncClient(timeout=2) as http:
            # readiness goes false while Redis is down, and true again once it is back
            assert await readiness_becomes(http, api, 503)
            await asyncio.to_thread(server.start)  # an empty Redis on the same port
            assert await readiness_becomes(http, api, 200)
        # the connected session lived only in the lost Redis: nothing it says can be
        # journaled again, and its client is told so rather than left waiting
        await connected.send({"type": "session.heartbeat", "event_id": "after"})
        resync = (await connected.until("session.resync_required", timeout=30))[-1]
        assert (resync.session_id, resync.reason) == (connected.session_id, "journal_gap")
        await connected.close(end_session=False)
        client = DuplexClient([api.base], heartbeat_s=None)
        await client.connect({"extra_body": {"pace": 0}})  # a new session works on the new Redis
        await client.send({"type": "session.heartbeat"})
        assert (await client.until("session.heartbeat_ack"))[-1].session_id == client.session_id
        await client.close()
        assert (
            api.process.poll() is None and fleet.workers["w-1"].process.poll() is None
        )  # no restarts
    finally:
        await fleet.close()
        server.stop()
