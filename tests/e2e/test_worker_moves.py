"""Sessions outlive their worker: SIGKILL (failover from the checkpoint), SIGTERM (drain and
move), a stalled worker coming back (fenced out), and no room anywhere (a clear closure).

Real processes: two echo workers, two API pods, on one redis-server and on the 3-master
Redis Cluster. Heartbeats are fast (0.2 s, TTL 2 s) so a lost worker is noticed in about
three seconds. Every wait is for something the client or Redis shows, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from harness.processes import start_api, start_worker
from harness.recording_client import (
    Conversation,
    RecordingClient,
    check,
    disruptions_of,
    drain,
    speak,
    turn_audio,
    wait_answer,
)
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from tests.e2e.waits import until

FAST = {
    "DUPLEX_HEARTBEAT_INTERVAL_S": "0.2",
    "DUPLEX_HEARTBEAT_TTL_S": "2.0",
    "DUPLEX_DISCONNECT_GRACE_S": "30",
}
#: answered in real time: a long turn keeps its response in flight for seconds
REAL_TIME = {
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
    "extra_body": {"pace": 1},
}
FAST_ANSWERS = {**REAL_TIME, "extra_body": {"pace": 4}}


class Fleet:
    def __init__(self, url: str, workers: dict[str, int], **worker_env: str) -> None:
        self.url = url
        self.prefix = f"moves-{uuid.uuid4().hex[:6]}"
        self.keys = KeySchema(self.prefix)
        env = {**FAST, **worker_env}
        self.workers = {
            name: start_worker(url, self.prefix, name, DUPLEX_MAX_SESSIONS=str(slots), **env)
            for name, slots in workers.items()
        }
        self.apis = [start_api(url, self.prefix, f"api-{i}", **FAST) for i in range(2)]
        for api in self.apis:
            api.wait_ready()
        self.handle = connect(url)
        self.redis = self.handle.client
        self.clients: list[RecordingClient] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def wait_workers(self, count: int) -> None:
        await until(lambda: self.redis.zcard(self.keys.workers()), lambda n: n >= count)

    async def client(self, session: dict[str, Any], api: int = 0) -> RecordingClient:
        client = RecordingClient([self.apis[api].base], heartbeat_s=None)
        await client.connect(session)
        self.clients.append(client)
        self.tasks.append(asyncio.create_task(drain(client)))
        return client

    async def owner(self, session_id: str) -> str:
        return (await self.redis.hget(self.keys.session(session_id), "worker")).decode()

    async def close(self) -> None:
        for client in self.clients:
            await client.close(end_session=False)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for process in [*self.apis, *self.workers.values()]:
            process.stop()
        await self.handle.close()

    def tracebacks(self, *skip: str) -> int:
        processes = [*self.apis, *(w for n, w in self.workers.items() if n not in skip)]
        return sum(p.logs().count("Traceback") for p in processes)


async def frame(
    client: RecordingClient,
    match: Callable[[dict[str, Any]], bool],
    timeout: float = 30,
    since: int = 0,
) -> dict[str, Any]:
    """The first frame delivered to the client from index `since` on that `match`es
    (waiting for it)."""

    async def find() -> dict[str, Any] | None:
        return next((f for f in client.delivered[since:] if match(f)), None)

    return await until(find, lambda found: found is not None, timeout)


def of_type(wire_type: str, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    def match(data: dict[str, Any]) -> bool:
        return data.get("type") == wire_type and all(data.get(k) == v for k, v in fields.items())

    return match


@pytest.fixture(params=["redis", "redis-cluster"])
async def backend_url(request):
    name = "redis_server" if request.param == "redis" else "redis_cluster"
    return request.getfixturevalue(name).url


@pytest.fixture
async def fleet_of(backend_url):
    fleets: list[Fleet] = []

    async def make(workers: dict[str, int], **worker_env: str) -> Fleet:
        fleet = Fleet(backend_url, workers, **worker_env)
        fleets.append(fleet)
        await fleet.wait_workers(len(workers))
        return fleet

    yield make
    for fleet in fleets:
        await fleet.close()


async def answered_turn(conversation: Conversation, ms: int, timeout: float = 20) -> None:
    pcm = turn_audio(ms)
    conversation.spoken[ms] = pcm
    client = conversation.client
    before = disruptions_of(client)
    await speak(client, pcm)
    assert await wait_answer(client, ms, timeout, before), f"turn of {ms} ms unanswered"


async def response_playing(conversation: Conversation, ms: int) -> str:
    """Speak a turn of `ms` answered in real time; the id of its response, once its first
    audio is out (whatever happens to the worker now lands while the response plays)."""
    client = conversation.client
    pcm = turn_audio(ms)
    conversation.spoken[ms] = pcm
    mark = len(client.delivered)
    await speak(client, pcm)
    created = await frame(client, of_type("response.created"), timeout=20, since=mark)
    in_flight = created["response"]["id"]
    await frame(client, of_type("response.output_audio.delta", response_id=in_flight))
    return in_flight


async def test_a_killed_workers_session_goes_on_elsewhere_with_its_history(fleet_of):
    fleet = await fleet_of({"w-a": 4, "w-b": 4})
    client = await fleet.client(REAL_TIME)
    conversation = Conversation(client, 0)
    sid = client.session_id
    note = {
        "id": "item_note",
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "remember me"}],
    }
    await client.send({"type": "conversation.item.create", "item": note})
    await frame(client, lambda f: (f.get("item") or {}).get("id") == "item_note")
    await answered_turn(conversation, 300)
    owner = await fleet.owner(sid)
    in_flight = await response_playing(conversation, 4000)
    fleet.workers[owner].kill()

    done = await frame(
        client, lambda f: f["type"] == "response.done" and f["response"]["id"] == in_flight
    )
    assert done["response"]["status"] == "failed"
    error = done["response"]["status_details"]["error"]
    assert error["code"] == "worker_lost" and error.get("retryable") is True, error
    assert client.session_id == sid
    assert await fleet.owner(sid) != owner
    # the conversation goes on on the other worker: the next turn echoes exactly
    await answered_turn(conversation, 320)
    # what was created before the kill is still there
    await client.send({"type": "conversation.item.retrieve", "item_id": "item_note"})
    retrieved = await frame(client, of_type("conversation.item.retrieved"))
    assert retrieved["item"]["id"] == "item_note"
    assert retrieved["item"]["content"][0]["text"] == "remember me"
    # nothing partial of the failed response is left in history
    await client.send({"type": "conversation.item.retrieve", "item_id": "item_" + in_flight})
    missing = await frame(
        client, lambda f: f["type"] == "error" and f["error"]["code"] == "item_not_found"
    )
    assert missing["error"]["code"] == "item_not_found"
    figures = check(conversation)
    assert (figures["lost"], figures["duplicated"], figures["mismatched"]) == (0, 0, 0)
    assert not any(f["type"] == "session.closed" for f in client.delivered)
    assert fleet.tracebacks(owner) == 0


async def test_a_drained_worker_finishes_the_response_and_the_session_moves(fleet_of):
    fleet = await fleet_of({"w-a": 4, "w-b": 4})
    client = await fleet.client(REAL_TIME)
    conversation = Conversation(client, 0)
    sid = client.session_id
    await answered_turn(conversation, 300)
    owner = await fleet.owner(sid)
    await response_playing(conversation, 2000)
    drained = fleet.workers[owner]
    drained.process.send_signal(signal.SIGTERM)
    # the response in flight completes on the draining worker, whole
    assert await wait_answer(client, 2000, 30)
    await until(lambda: fleet.owner(sid), lambda worker: worker != owner)
    # and the next turn is answered by the new owner
    await answered_turn(conversation, 320)
    assert await asyncio.to_thread(drained.process.wait, 60) == 0
    meta = await fleet.redis.hgetall(fleet.keys.session(sid))
    assert meta[b"moved_why"] == b"drain" and int(meta[b"restored_at"]) >= int(meta[b"paused_at"])
    figures = check(conversation)
    assert (figures["lost"], figures["duplicated"], figures["mismatched"]) == (0, 0, 0)
    assert [rid for rid, status, _ in client.done if status != "completed"] == []
    assert not any(f["type"] in ("session.closed", "error") for f in client.delivered)
    assert fleet.tracebacks() == 0


async def test_a_stalled_worker_that_comes_back_is_fenced_out(fleet_of):
    fleet = await fleet_of({"w-a": 4, "w-b": 4})
    client = await fleet.client(REAL_TIME)
    conversation = Conversation(client, 0)
    sid = client.session_id
    await answered_turn(conversation, 300)
    owner = await fleet.owner(sid)
    in_flight = await response_playing(conversation, 4000)
    zombie = fleet.workers[owner]
    os.kill(zombie.process.pid, signal.SIGSTOP)
    try:
        await until(lambda: fleet.owner(sid), lambda worker: worker != owner)
        done = await frame(
            client, lambda f: f["type"] == "response.done" and f["response"]["id"] == in_flight
        )
        assert done["response"]["status"] == "failed"
    finally:
        os.kill(zombie.process.pid, signal.SIGCONT)
    # the zombie runs again with the response it had in flight and drops the session: its
    # publisher's write is refused (fenced), or its heartbeat finds it was swept first and
    # checks its owners; either way it logs the drop and writes nothing for the session
    await until(
        lambda: asyncio.to_thread(zombie.logs),
        lambda logs: f"session {sid} dropped" in logs,
        timeout=30,
    )
    await answered_turn(conversation, 320)
    after_done = client.delivered[client.delivered.index(done) + 1 :]
    assert not any(f.get("response_id") == in_flight for f in after_done)  # no stray delta
    figures = check(conversation)
    assert (figures["lost"], figures["duplicated"], figures["mismatched"]) == (0, 0, 0)


async def test_with_no_room_anywhere_a_lost_workers_session_closes_with_worker_lost(fleet_of):
    fleet = await fleet_of({"w-a": 1, "w-b": 1})
    first = await fleet.client(FAST_ANSWERS)
    second = await fleet.client(FAST_ANSWERS, api=1)
    owner = await fleet.owner(first.session_id)
    assert await fleet.owner(second.session_id) != owner  # both workers are full
    killed_at = time.monotonic()
    fleet.workers[owner].kill()
    closed = await frame(first, of_type("session.closed"), timeout=20)
    assert closed["reason"] == "worker_lost"
    error = next(f for f in first.delivered if f["type"] == "error")
    assert error["error"]["code"] == "worker_lost" and error["error"]["retryable"] is True
    assert time.monotonic() - killed_at < 15
    conversation = Conversation(second, 1)
    await answered_turn(conversation, 300)  # the other session is untouched
    assert not any(f["type"] == "session.closed" for f in second.delivered)
