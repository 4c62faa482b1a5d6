"""One socket-level suite over every protocol the API pod speaks: the openai surface, the
duplex surface, GPT-Live and Moshi's protocol (`harness/protocol_clients.py`: a protocol's
client registered there gets every test here).

Real `duplex api` and `duplex worker --plugin harness.frame_models:EchoFramePlugin`
processes on redis-server; the echo frame model says each loud frame back 2 frames later,
so "the model speaks back" is something every protocol's client hears. Each test: a
session opens and the model speaks back; a wrong key is refused before the upgrade; a
malformed message is refused as the protocol says it, and the session goes on (or the
socket closes, where that is the protocol's answer); a barge-in cuts the model's speech
(where the protocol has one); a dropped socket is resumed (the duplex surface) or ends
its session; the session outlives its worker's drain (SIGTERM) and its loss (SIGKILL).
Every wait is for something the socket or Redis shows.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
from websockets.exceptions import InvalidStatus

from harness.frame_models import RATE, tone
from harness.processes import start_api, start_worker
from harness.protocol_clients import PROTOCOL_CLIENTS, ProtocolClient
from shared.redis.keys import KeySchema
from tests.e2e.waits import until

PLUGIN = "harness.frame_models:EchoFramePlugin"
MODEL = "frame_echo"
CHECKOUT = str(Path(__file__).resolve().parents[2])
KEY = "k-suite"
FAST = {"DUPLEX_HEARTBEAT_INTERVAL_S": "0.2", "DUPLEX_HEARTBEAT_TTL_S": "2.0"}
WAIT_S = 30
#: a second of speech, then half a second of quiet: the model says it back and stops
UTTERANCE = np.concatenate([tone(12), np.zeros(RATE // 2, np.float32)])
PROTOCOLS = sorted(PROTOCOL_CLIENTS)
BARGE_IN = sorted(name for name, client in PROTOCOL_CLIENTS.items() if client.barge_in_message)


class Stack:
    """An API pod (with an API key) and native workers on one key prefix."""

    def __init__(self, redis_url: str, workers: int, name: str) -> None:
        self.prefix = f"duplex-suite-{name}-{uuid.uuid4().hex[:8]}"
        self.keys = KeySchema(self.prefix)
        env = {"PYTHONPATH": CHECKOUT, **FAST}
        self.workers = [
            start_worker(redis_url, self.prefix, f"{name}-w{i}", PLUGIN, **env)
            for i in range(workers)
        ]
        self.api = start_api(redis_url, self.prefix, f"{name}-api", DUPLEX_API_KEYS=KEY, **FAST)
        self.redis = redis.Redis.from_url(redis_url)
        try:
            self.api.wait_ready()
            deadline = time.monotonic() + 60
            while self.redis.zcard(self.keys.workers()) < workers:
                assert time.monotonic() < deadline, "the workers did not register"
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def client(self, protocol: str, key: str | None = KEY) -> ProtocolClient:
        return PROTOCOL_CLIENTS[protocol](self.api.base, MODEL, key)

    def sessions(self) -> set[bytes]:
        return {
            key for key in self.redis.scan_iter(match=self.keys.session("*")) if key.endswith(b"}")
        }

    def field(self, session_key: bytes, name: str) -> str | None:
        value = self.redis.hget(session_key, name)
        return value.decode() if value is not None else None

    def stop(self) -> None:
        for process in (self.api, *self.workers):
            process.stop()
        self.redis.close()


@pytest.fixture(scope="module")
def stack(redis_server):
    made = Stack(redis_server.url, 2, "m")
    yield made
    made.stop()


@pytest.fixture
def moving(redis_server):
    """A stack of its own for a test that stops one of its two workers."""
    made = Stack(redis_server.url, 2, "f")
    yield made
    made.stop()


async def opened(stack: Stack, client: ProtocolClient) -> bytes:
    """Open the client's session; its hash key (found in Redis for a protocol that never
    names its session: the one key that is new)."""
    before = stack.sessions()
    await client.open()
    if client.session_id:
        return stack.keys.session(client.session_id).encode()
    (key,) = await until(
        lambda: asyncio.to_thread(lambda: stack.sessions() - before), lambda new: len(new) == 1
    )
    return key


async def speaks_back(client: ProtocolClient, more_than: int = 0) -> None:
    """Say the utterance; the model's speech comes back (loud frames, counted)."""
    await client.speak(UTTERANCE)
    await until(_read(lambda: client.loud), lambda n: n > more_than, WAIT_S)


def _read(read):
    async def call():
        return read()

    return call


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_session_opens_and_the_model_speaks_back(stack, protocol):
    async with stack.client(protocol) as client:
        await speaks_back(client)
        assert client.errors == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_wrong_key_is_refused_before_the_upgrade(stack, protocol):
    for key in (None, "not-the-key"):
        with pytest.raises(InvalidStatus) as refused:
            await stack.client(protocol, key).open()
        assert refused.value.response.status_code == 401


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_malformed_message_is_refused_as_the_protocol_says_it(stack, protocol):
    async with stack.client(protocol) as client:
        await client.send_malformed()
        said = await until(_read(client.refusal), lambda refusal: refusal is not None, WAIT_S)
        assert said == client.malformed_refusal
        if said.startswith("close:"):
            return  # the protocol's answer is the socket's close
        await speaks_back(client)  # and the session goes on


@pytest.mark.parametrize("protocol", BARGE_IN)
async def test_a_barge_in_cuts_the_models_speech(stack, protocol):
    async with stack.client(protocol) as client:
        speaking = asyncio.create_task(client.speak(tone(40)))  # 3.2 s: it speaks over it
        try:
            await until(_read(lambda: client.loud), lambda n: n > 0, WAIT_S)
            await client.barge_in()
            await until(_read(client.cancelled), bool, WAIT_S)
        finally:
            speaking.cancel()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_dropped_socket_is_resumed_or_ends_its_session(stack, protocol):
    client = stack.client(protocol)
    key = await opened(stack, client)
    try:
        await speaks_back(client)
        heard = client.loud
        await client.drop()
        if not client.resumes:  # the socket was the session
            await until(
                lambda: asyncio.to_thread(stack.field, key, "state"), lambda s: s == "closed"
            )
            return
        await until(lambda: asyncio.to_thread(stack.field, key, "state"), lambda s: s != "active")
        assert await client.resume()
        await speaks_back(client, more_than=heard)
        assert stack.field(key, "state") == "active"
    finally:
        await client.close()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["drain", "failover"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_session_outlives_its_worker(moving, protocol, how):
    """SIGTERM: a drain moves the session at once. SIGKILL: the dead worker's sessions are
    restored on the other one. Either way the client, on its one socket, hears the model
    again, and no error reaches it."""
    client = moving.client(protocol)
    key = await opened(moving, client)
    try:
        await speaks_back(client)
        owner = moving.field(key, "worker")
        worker = next(w for w in moving.workers if w.name == owner)
        worker.process.send_signal(how)
        await until(
            lambda: asyncio.to_thread(moving.field, key, "worker"),
            lambda now: now is not None and now != owner,
            WAIT_S,
        )
        heard = client.loud
        await speaks_back(client, more_than=heard)
        assert client.errors == [] and client.close_code is None
    finally:
        await client.close()
