"""The composition root (services/api/pod.py): it builds every part from settings and one
Redis handle, starts the pod's loops under their names, stops every one of them, and
answers readiness; `connection()` wires one socket's parts."""

import asyncio

import redis.asyncio as redis_async

from harness.redis_server import free_port
from services.api.app import create_app
from services.api.attachment import AttachmentState
from services.api.pod import ApiPod
from shared.ids import key_digest
from shared.redis.boundary import CloseRequest, decode_entry
from shared.redis.connection import RedisHandle, connect
from shared.redis.keys import KeySchema
from shared.settings import ApiSettings
from tests.api.parts import register_worker

KEYS = KeySchema()
#: the pod's long-lived tasks, by name (the inbox writer starts with the first write)
LOOPS = {"live-hub", "api-heartbeat", "janitor", "loop-lag-API pod api-p", "inbox-writer"}


def running(names: set[str]) -> set[str]:
    return {task.get_name() for task in asyncio.all_tasks() if not task.done()} & names


async def test_the_pod_starts_its_named_loops_and_stops_every_one():
    handle = connect(None)
    pod = ApiPod(ApiSettings(pod_id="api-p"), handle)
    assert running(LOOPS) == set()
    await pod.start()
    assert running(LOOPS) == LOOPS - {"inbox-writer"}
    assert await handle.client.zscore(KEYS.apis(), "api-p") is not None  # first heartbeat
    await pod.workers.close("w1", "duplex-x", 0, "test")
    assert running(LOOPS) == LOOPS
    await pod.stop()
    assert running(LOOPS) == set()
    assert await handle.client.zscore(KEYS.apis(), "api-p") is None  # deregistered
    [(_, fields)] = await handle.client.xrange(KEYS.inbox("w1"))
    [close] = decode_entry(fields)  # what was written before the stop stays written
    assert isinstance(close, CloseRequest)


async def test_ready_says_which_dependency_is_missing():
    handle = connect(None)
    pod = ApiPod(ApiSettings(pod_id="api-p"), handle)
    assert await pod.ready() == (False, "live event channel reconnecting")  # not started
    await pod.start()
    try:
        assert await pod.ready() == (False, "no live worker")
        await register_worker(handle.client, "w1")
        assert await pod.ready() == (True, "ok")
        assert await pod.models() == ["echo"]
    finally:
        await pod.stop()


async def test_an_unreachable_redis_is_not_ready_and_the_reason_names_no_host():
    dead = redis_async.Redis(port=free_port(), socket_connect_timeout=0.5)
    pod = ApiPod(ApiSettings(pod_id="api-p"), RedisHandle(dead, "dead"))
    assert await pod.ready() == (False, "redis unreachable")
    assert await pod.ready() == (False, "redis unreachable")  # logged once, answered each time
    await dead.aclose()


async def test_each_socket_gets_its_own_parts_wired_to_the_pods():
    settings = ApiSettings(pod_id="api-p", api_keys=frozenset({"k1"}))
    pod = ApiPod(settings, connect(None))
    first = pod.connection(None, model="echo", autostart=True, resume_only=False, api_key="k1")
    second = pod.connection(None, model=None, autostart=True, resume_only=True, api_key=None)
    assert first.attachment is not second.attachment
    assert first.delivery.attachment is first.attachment and first.view is first.delivery.view
    assert first.attachment.state is AttachmentState.NEW
    # the session is bound to the key that opens it; without keys nothing is bound
    assert first.attachment.key_sha == key_digest("k1") and second.attachment.key_sha == ""
    assert (first.autostart, second.autostart, second.resume_only) == (True, False, True)
    runtime = pod.runtime
    assert first.max_input_bytes == runtime.max_pending_input_bytes_per_session
    assert first.config_timeout_s == settings.config_timeout_s
    assert first.attachment.open_timeout_s == settings.open_timeout_s
    assert first.delivery.queue.max_events == runtime.max_pending_output_events_per_session


def test_create_app_puts_the_pod_behind_its_routes():
    app = create_app(ApiSettings(pod_id="api-p"), connect(None))
    assert isinstance(app.state.pod, ApiPod)
    assert {route.path for route in app.routes} >= {
        "/v1/realtime",
        "/v1/duplex",
        "/",
        "/console",
        "/health",
        "/health/ready",
        "/metrics",
        "/v1/models",
        "/v1/chat/completions",
    }
