"""The API image and the cascade worker image, run as the chart renders them: Redis, one API
pod and two echo workers (a StatefulSet of 2). The openai SDK speaks a realtime turn through
the API pod; a worker container is SIGKILLed while a session talks and the session goes on on
the other worker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as redis_async

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
from shared.redis.keys import KeySchema
from tests.e2e.openai_turns import realtime_turn
from tests.e2e.waits import until
from tests.images.conftest import Release, release_values

#: answered in real time, so a long turn keeps its response in flight while the worker dies
REAL_TIME = {
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
    "extra_body": {"pace": 1},
}


#: the module's pods start once, for its tests: their set-up (images' start, a model's
#: load, probes) counts against the first test's time
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def echo(start_release) -> Release:
    return start_release("echo", release_values(replicas=2, plugin="echo", maxSessions=4))


async def test_the_pods_run_as_the_chart_says(echo: Release):
    """Non-root, a read-only root with /tmp writable, every probe answered, and each worker
    registered under its pod's name (the downward API's metadata.name)."""
    for pod in [echo.api, *echo.workers]:
        assert pod.exec("id", "-u").stdout.strip() == "10001"
        refused = pod.exec("python", "-c", "open('/written', 'w')")
        assert "Read-only file system" in refused.stderr, refused.stderr
        assert pod.exec("python", "-c", "open('/tmp/written', 'w')").returncode == 0
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in pod.container:
                assert pod.probe(probe), f"{pod.name}: {probe}"
    assert echo.redis.probe("readinessProbe") and echo.redis.probe("livenessProbe")
    client = redis_async.Redis.from_url(echo.redis_url())
    try:
        keys = KeySchema(echo.key_prefix())
        registered = {m.decode() for m in await client.zrange(keys.workers(), 0, -1)}
    finally:
        await client.aclose()
    assert registered == {"echo-duplex-worker-0", "echo-duplex-worker-1"}


async def test_a_realtime_turn_with_the_openai_sdk(echo: Release):
    turn = await realtime_turn(echo.api_base)
    assert turn.status == "completed"
    assert turn.transcript == "echo 500 ms"
    assert len(turn.audio) == 24000  # 0.5 s of pcm16 at 24 kHz


def first(client: RecordingClient, match: Callable[[dict[str, Any]], bool], since: int = 0):
    async def find() -> dict[str, Any] | None:
        return next((f for f in client.delivered[since:] if match(f)), None)

    return until(find, lambda found: found is not None, 60)


async def test_a_worker_container_killed_while_a_session_talks(echo: Release):
    client = RecordingClient([echo.api_base], heartbeat_s=None)
    await client.connect(REAL_TIME)
    reader = asyncio.create_task(drain(client))
    redis = redis_async.Redis.from_url(echo.redis_url())
    keys = KeySchema(echo.key_prefix())
    try:
        conversation = Conversation(client, 0)
        pcm = turn_audio(300)
        conversation.spoken[300] = pcm
        await speak(client, pcm)
        assert await wait_answer(client, 300, 30, 0), "the first turn was not answered"
        owner = (await redis.hget(keys.session(client.session_id), "worker")).decode()

        # a long turn answered in real time: its response is playing when the owner dies
        long_turn = turn_audio(4000)
        conversation.spoken[4000] = long_turn
        mark = len(client.delivered)
        await speak(client, long_turn)
        created = await first(client, lambda f: f["type"] == "response.created", mark)
        in_flight = created["response"]["id"]
        await first(
            client,
            lambda f: (
                f["type"] == "response.output_audio.delta" and f.get("response_id") == in_flight
            ),
            mark,
        )
        (victim,) = [pod for pod in echo.workers if pod.name.endswith(owner)]
        victim.kill()

        done = await first(
            client,
            lambda f: f["type"] == "response.done" and f["response"]["id"] == in_flight,
            mark,
        )
        assert done["response"]["status"] == "failed"
        assert done["response"]["status_details"]["error"]["code"] == "worker_lost"
        # the same session talks on, on the other worker
        new_owner = (await redis.hget(keys.session(client.session_id), "worker")).decode()
        assert new_owner != owner
        pcm = turn_audio(320)
        conversation.spoken[320] = pcm
        before = disruptions_of(client)
        await speak(client, pcm)
        assert await wait_answer(client, 320, 30, before), "no answer after the failover"
        figures = check(conversation)
        assert (figures["lost"], figures["duplicated"], figures["mismatched"]) == (0, 0, 0)
        assert not any(f["type"] == "session.closed" for f in client.delivered)
    finally:
        await client.close(end_session=False)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await redis.aclose()
    survivor = next(pod for pod in echo.workers if pod is not victim)
    assert "Traceback" not in survivor.logs()
    assert "Traceback" not in echo.api.logs()
