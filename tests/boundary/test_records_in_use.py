"""Both sides of the boundary over one embedded Redis: the worker writes its registration and
answers with the records of shared/redis/boundary.py, placement and `duplex workers` read them
back, commands reach a session without a second parse, and the worker's loops are supervised."""

import asyncio
import io
import logging

import orjson
import pytest
from starlette.requests import Request

import shared.protocol.duplex as duplex
from services.admin import Admin
from services.api.chat import ChatCompletions
from services.api.inbox_writer import InboxWriter
from services.api.worker_client import WorkerClient
from services.worker.process import WorkerProcess
from shared.protocol.duplex import DUPLEX_COMMANDS, AppendAudio, CloseSession, Heartbeat
from shared.redis.boundary import (
    ChatReply,
    ChatRequest,
    CommandRecord,
    InboxRecord,
    OpenRequest,
    WorkerRegistration,
)
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from shared.redis.live_message import split
from shared.redis.placement import WorkerDirectory
from shared.redis.store import SessionStore
from shared.settings import WorkerSettings

KEYS = KeySchema()
SID = "duplex-00000000000000000000000000000b0d"
LOOPS = {"worker-heartbeat", "worker-inbox", "worker-inbox-ack", "event-publisher"}


class Setup:
    def __init__(self, worker_id: str, max_sessions: int = 2) -> None:
        self.handle = connect(None)
        self.client = self.handle.client
        self.store = SessionStore(self.client, KEYS)
        self.worker = WorkerProcess(
            WorkerSettings(worker_id=worker_id, max_sessions=max_sessions), self.handle
        )
        self.pubsub = self.handle.new_client().pubsub()

    async def send(self, record: InboxRecord) -> None:
        await self.store.inbox_append(self.worker.worker_id, record.to_fields())

    async def events_until(self, last_type: str) -> list[dict]:
        received: list[dict] = []
        async with asyncio.timeout(10):
            while not received or received[-1]["type"] != last_type:
                message = await self.pubsub.get_message(timeout=1)
                if message and message["type"] == "message":  # one publisher round's events
                    received += [orjson.loads(r.data) for r in split(message["data"])]
        return received


@pytest.fixture
async def setup():
    s = Setup("w-boundary")
    yield s
    await s.pubsub.aclose()
    await s.worker.stop()


def chat_request(body: bytes) -> Request:
    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    return Request(scope, receive)


def running_loops() -> set[str]:
    return {task.get_name() for task in asyncio.all_tasks()} & LOOPS


async def test_placement_and_the_admin_read_the_registration_the_worker_writes(setup):
    await setup.worker.start()
    assert running_loops() == LOOPS
    directory = WorkerDirectory(setup.client, KEYS, heartbeat_ttl_s=60)
    [registration] = await directory.live_workers()
    assert registration == setup.worker.registration
    assert registration == WorkerRegistration(
        worker_id="w-boundary",
        model="echo",
        max_sessions=2,
        active=0,
        capabilities=setup.worker.manager.builder.capabilities.to_realtime(),
        version="0.1.0",
        started_at=registration.started_at,
    )
    assert registration.started_at > 0

    out = io.StringIO()
    await Admin(setup.handle, KEYS, out, io.StringIO()).workers(as_json=True)
    row = orjson.loads(out.getvalue())
    assert row.pop("heartbeat_age_s") >= 0
    assert row == {
        "worker_id": "w-boundary",
        "model": "echo",
        "max_sessions": "2",
        "active": "0",
        "version": "0.1.0",
        "started_at": str(registration.started_at),
        "draining": "0",
    }
    await setup.worker.stop()
    assert running_loops() == set()


async def test_commands_reach_the_session_without_a_second_parse(setup, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the worker parsed or validated a command again")

    monkeypatch.setattr(duplex, "parse_client_event", refuse)
    for cls in DUPLEX_COMMANDS.values():
        monkeypatch.setattr(cls, "from_wire", classmethod(refuse))
    await setup.worker.start()
    await setup.store.open(SID, "w-boundary", "echo", "", "{}")
    await setup.pubsub.subscribe(KEYS.live(SID))
    await setup.send(OpenRequest(SID, {}))
    await setup.send(CommandRecord(SID, 1, 1, Heartbeat(event_id="h1")))
    append = AppendAudio(event_id="a1", audio=b"\x00\x00" * 160)
    await setup.send(CommandRecord(SID, 1, 2, append))
    await setup.send(CommandRecord(SID, 1, 2, append))  # a redelivery: dropped
    await setup.send(CommandRecord(SID, 1, 3, Heartbeat(event_id="h2")))
    await setup.send(CommandRecord(SID, 1, 4, CloseSession(event_id="c1")))
    events = await setup.events_until("session.closed")
    assert [e["type"] for e in events] == [
        "session.created",
        "session.updated",
        "session.heartbeat_ack",
        "input_audio_buffer.speech_started",  # the append's audio reached the session
        "session.heartbeat_ack",
        "session.closed",
    ]
    assert setup.worker.manager.table.live_ids() == []


async def test_a_chat_request_is_answered_with_a_chat_reply(setup):
    await setup.worker.start()
    await setup.send(ChatRequest("r1", [{"role": "user", "content": "hi"}]))
    _, data = await setup.client.blpop([KEYS.reply("r1")], timeout=10)
    assert ChatReply.parse(data) == ChatReply.answer("echo: hi")


async def test_the_chat_route_answers_with_the_workers_reply(setup):
    """API side: ChatCompletions writes a ChatRequest, reads the ChatReply back."""
    await setup.worker.start()
    inbox = InboxWriter(setup.client, KEYS)
    directory = WorkerDirectory(setup.client, KEYS, heartbeat_ttl_s=60)
    route = ChatCompletions(setup.client, KEYS, directory, 1 << 20, 10.0, WorkerClient(inbox))
    body = orjson.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}]})
    try:
        response = await route(chat_request(body))
    finally:
        await inbox.stop()
    answer = orjson.loads(response.body)
    assert response.status_code == 200 and answer["model"] == "echo"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "echo: hi"}


async def test_a_chat_request_past_capacity_is_answered_with_the_error():
    s = Setup("w-chat-full", max_sessions=1)
    await s.worker.start()
    try:
        await s.store.open(SID, "w-chat-full", "echo", "", "{}")
        await s.store.inbox_append("w-chat-full", OpenRequest(SID, {}).to_fields())
        await s.send(ChatRequest("r2", [{"role": "user", "content": "hi"}]))
        _, data = await s.client.blpop([KEYS.reply("r2")], timeout=10)
        reply = ChatReply.parse(data)
        assert (reply.ok, reply.code) == (False, "resource_exhausted")
        assert reply.message.startswith("duplex_session_capacity_exhausted")
    finally:
        await s.pubsub.aclose()
        await s.worker.stop()


async def test_a_failed_inbox_loop_is_logged_and_restarted(setup, monkeypatch, caplog):
    real = setup.handle.new_client
    calls = 0

    def new_client_failing_once():
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("no connection for the blocking reader yet")
        return real()

    monkeypatch.setattr(setup.handle, "new_client", new_client_failing_once)
    await setup.store.open(SID, "w-boundary", "echo", "", "{}")
    await setup.pubsub.subscribe(KEYS.live(SID))
    with caplog.at_level(logging.WARNING, logger="duplex.loops"):
        await setup.worker.start()
        await setup.send(OpenRequest(SID, {}))
        [created] = await setup.events_until("session.created")
    assert created["session"]["id"] == SID
    [inbox_loop] = [loop for loop in setup.worker._loops if loop.name == "worker-inbox"]
    assert inbox_loop.failures == 1 and calls == 2
    [failure] = [r for r in caplog.records if "loop worker-inbox failed" in r.getMessage()]
    # Redis unreachable says it all in its message: logged once, without a traceback
    assert "no connection for the blocking reader yet" in failure.getMessage()
    assert failure.exc_info is None


async def test_a_beat_rewrites_a_lost_registration_and_a_failed_one_is_no_loop_failure(
    setup, monkeypatch
):
    """The whole registration is rewritten every beat: a Redis that lost it learns it again.
    A beat Redis refuses turns readiness false and waits for the next interval; the loop
    itself goes on (its supervisor sees no failure)."""
    await setup.worker.start()
    await setup.client.delete(KEYS.worker("w-boundary"))
    await setup.worker._heartbeat()
    stored = await setup.client.hgetall(KEYS.worker("w-boundary"))
    assert WorkerRegistration.from_hash("w-boundary", stored) == setup.worker.registration
    assert setup.worker.readiness() == (True, "ok")

    async def refused() -> None:
        raise ConnectionError("Redis is away")

    monkeypatch.setattr(setup.worker, "_beat", refused)
    await setup.worker._heartbeat()
    assert setup.worker.readiness() == (False, "redis unreachable: the last heartbeat failed")
    [heartbeat] = [loop for loop in setup.worker._loops if loop.name == "worker-heartbeat"]
    assert heartbeat.running and heartbeat.failures == 0
