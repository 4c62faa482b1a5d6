"""Hostile and unlucky sessions against real processes (issue 14): what one client can leave
in Redis, a pod that stalls past its heartbeat TTL, a resume with another key, odd models.

Heartbeats are fast (0.2 s, TTL 2 s) so a stalled pod is declared dead in about three
seconds; the janitor ticks every second.
"""

import asyncio
import base64
import os
import signal
import time
import uuid

import orjson
import pytest
import redis.asyncio as redis_async
import websockets

from harness.processes import start_api, start_worker
from shared.client.duplex_client import realtime_url
from shared.redis.keys import KeySchema

KEYS_ENV = "k1,k2"
FAST = {
    "DUPLEX_HEARTBEAT_INTERVAL_S": "0.2",
    "DUPLEX_HEARTBEAT_TTL_S": "2.0",
    "DUPLEX_DISCONNECT_GRACE_S": "4.0",
    "DUPLEX_API_KEYS": KEYS_ENV,
}
MIB = 1024 * 1024


class Fleet:
    def __init__(self, redis_url: str) -> None:
        self.prefix = f"hostile-{uuid.uuid4().hex[:6]}"
        self.keys = KeySchema(self.prefix)
        self.worker = start_worker(redis_url, self.prefix, "hostile-worker", **FAST)
        self.apis = [start_api(redis_url, self.prefix, f"api-{i}", **FAST) for i in range(2)]
        for api in self.apis:
            api.wait_ready(headers={"Authorization": "Bearer k1"})
        self.redis_url = redis_url
        self.redis: redis_async.Redis  # one per test: each test runs its own event loop

    def url(self, api: int, key: str, *, resume: bool = False) -> str:
        return realtime_url(self.apis[api].base, resume=resume) + f"&api_key={key}"

    async def state(self, sid: str) -> str | None:
        value = await self.redis.hget(self.keys.session(sid), "state")
        return value.decode() if value else None

    async def until_state(self, sid: str, wanted: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while (state := await self.state(sid)) != wanted:
            assert time.monotonic() < deadline, f"{sid} stayed {state}, never {wanted}"
            await asyncio.sleep(0.05)

    async def stored_bytes(self) -> int:
        """MEMORY USAGE of every key of this fleet (sessions, journals, inboxes, registry)."""
        total = 0
        async for key in self.redis.scan_iter(match=f"{self.prefix}:*", count=1000):
            total += await self.redis.memory_usage(key, samples=0) or 0
        return total

    def close(self) -> None:
        for process in [*self.apis, self.worker]:
            process.stop()


@pytest.fixture(scope="module")
def fleet_processes(redis_server):
    fleet = Fleet(redis_server.url)
    yield fleet
    fleet.close()


@pytest.fixture
async def fleet(fleet_processes):
    fleet_processes.redis = redis_async.Redis.from_url(fleet_processes.redis_url)
    yield fleet_processes
    await fleet_processes.redis.aclose()


async def recv(ws, until: str, timeout: float = 30) -> list[dict]:
    """Events up to and including the first of type `until`."""
    events: list[dict] = []
    async with asyncio.timeout(timeout):
        while not events or events[-1]["type"] != until:
            events.append(orjson.loads(await ws.recv()))
    return events


async def open_session(ws, session: dict | None = None) -> dict:
    await ws.send(orjson.dumps({"type": "session.update", "session": session or {}}).decode())
    created = (await recv(ws, "session.created"))[-1]
    await recv(ws, "session.updated")  # the open's second event
    return created


async def test_redis_memory_returns_to_its_baseline_after_a_hostile_session(fleet):
    """Before: every append's audio stayed in the worker's inbox (XACK, never deleted):
    one session left ~40 MB/s in Redis. Now the worker deletes what it handled."""
    before = await fleet.redis.info("memory")
    stored_before = await fleet.stored_bytes()
    chunk = base64.b64encode(b"\x00\x01" * (2 * MIB)).decode()  # 4 MiB of pcm16 a frame
    sent = 0
    async with websockets.connect(fleet.url(0, "k1"), max_size=None) as ws:
        created = await open_session(ws)
        sid = created["session"]["id"]
        for n in range(10):
            frame = {"type": "input_audio_buffer.append", "audio": chunk, "event_id": f"a{n}"}
            await ws.send(orjson.dumps(frame).decode())
            sent += 4 * MIB
        await ws.send(orjson.dumps({"type": "session.heartbeat", "event_id": "hb"}).decode())
        events = await recv(ws, "session.heartbeat_ack", timeout=120)
        refused = [e for e in events if e["type"] == "error"]
        assert refused and {e["error"]["code"] for e in refused} == {"input_backpressure"}
        await ws.send(orjson.dumps({"type": "session.close"}).decode())
        await recv(ws, "session.closed")
    inbox = fleet.keys.inbox("hostile-worker")
    deadline = time.monotonic() + 30
    while await fleet.redis.xlen(inbox):  # the worker handles (and deletes) what is left
        assert time.monotonic() < deadline, "the inbox was never emptied"
        await asyncio.sleep(0.05)
    # what is stored: the audio of the appends is gone with their inbox entries
    stored = await fleet.stored_bytes() - stored_before
    assert stored < sent // 100, f"Redis keeps {stored} bytes of the {sent} sent ({sid})"
    # and all of it: the connections' query buffers that carried the audio are given back
    # by Redis once they are idle (its clientsCron, about 2 s): wait for that
    deadline = time.monotonic() + 60
    while (
        grown := int((await fleet.redis.info("memory"))["used_memory"]) - int(before["used_memory"])
    ) > sent // 5:
        assert time.monotonic() < deadline, f"Redis grew by {grown} bytes and stayed"
        await asyncio.sleep(0.2)
    assert int(await fleet.redis.get(fleet.keys.inbox_bytes("hostile-worker")) or 0) == 0


async def test_a_pod_that_stalls_past_its_ttl_keeps_its_attached_sessions(fleet):
    """Before: the other pod's janitor declared the stalled pod dead, moved its sessions
    into disconnect grace, and nothing took them back: a connected client got
    session.expired when the grace ran out."""
    stalled = fleet.apis[0].process
    async with websockets.connect(fleet.url(0, "k1")) as ws:
        sid = (await open_session(ws))["session"]["id"]
        os.kill(stalled.pid, signal.SIGSTOP)  # a frozen event loop, as a long handler made it
        try:
            await fleet.until_state(sid, "detached")  # api-1's sweep declared api-0 dead
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        await fleet.until_state(sid, "active")  # taken back on api-0's next beat
        # The lease index is written beside the hash (one slot per session in a cluster),
        # so the pod unindexes the deadline just after the script made the session active.
        deadline = time.monotonic() + 30
        while await fleet.redis.zscore(fleet.keys.leases(), sid) is not None:
            assert time.monotonic() < deadline, "the taken-back session's deadline stayed"
            await asyncio.sleep(0.05)
        # A canary detached after the sweep has a later grace deadline: once the janitor
        # has expired it, it has also passed the stalled session's deadline, where the
        # session used to be expired.
        async with websockets.connect(fleet.url(1, "k1")) as canary:
            canary_sid = (await open_session(canary))["session"]["id"]
        await fleet.until_state(canary_sid, "closed", timeout=60)
        await ws.send(orjson.dumps({"type": "session.heartbeat", "event_id": "hb"}).decode())
        events = await recv(ws, "session.heartbeat_ack")
        assert [e["type"] for e in events] == ["session.heartbeat_ack"]  # no session.expired
        assert await fleet.state(sid) == "active"
        await ws.send(orjson.dumps({"type": "session.close"}).decode())
        await recv(ws, "session.closed")


async def test_a_session_resumes_only_with_the_key_that_opened_it(fleet):
    async with websockets.connect(fleet.url(0, "k1")) as ws:
        created = await open_session(ws)
    sid, token = created["session"]["id"], created["resume_token"]
    await fleet.until_state(sid, "detached")
    resume = {
        "type": "session.resume",
        "session_id": sid,
        "resume_token": token,
        "last_received_server_event_seq": 0,
    }
    async with websockets.connect(fleet.url(1, "k2", resume=True)) as ws:
        await ws.send(orjson.dumps(resume).decode())
        refused = (await recv(ws, "error"))[-1]
    assert refused["error"]["code"] == "invalid_resume_token"
    assert await fleet.state(sid) == "detached"  # the refused attempt changed nothing
    async with websockets.connect(fleet.url(1, "k1", resume=True)) as ws:
        await ws.send(orjson.dumps(resume).decode())
        resumed = (await recv(ws, "session.resumed"))[-1]
        assert resumed["session_id"] == sid
        await ws.send(orjson.dumps({"type": "session.close"}).decode())
        await recv(ws, "session.closed")


@pytest.mark.parametrize("model", [[], "", 0, {"name": "echo"}])
async def test_a_model_that_is_not_a_name_is_refused_not_defaulted(fleet, model):
    async with websockets.connect(fleet.url(0, "k1")) as ws:
        await ws.send(
            orjson.dumps({"type": "session.update", "session": {"model": model}}).decode()
        )
        error = (await recv(ws, "error"))[-1]
        assert error["error"]["code"] == "invalid_session_config"
        assert error["error"]["param"] == "session.model"
        with pytest.raises(websockets.ConnectionClosed):
            await recv(ws, "session.created")  # nothing was opened: the socket closes
