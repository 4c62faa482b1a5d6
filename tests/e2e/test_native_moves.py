"""A model-native session keeps its model's memory when its worker goes (SIGTERM: a drain,
SIGKILL: a failover; a restart under the same id), with the echo frame model: its memory
is its step count, each frame's record the step number, so the history the new worker
writes must count on from the frames it restored. The move scenario and its checks:
tests/e2e/native_moves.py."""

from __future__ import annotations

import asyncio
import signal
import uuid

import numpy as np
import pytest

from bench.chaos import RecordingClient, drain
from harness.processes import start_api, start_worker
from harness.redis_server import free_port
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from tests.e2e.native_moves import CHECKOUT, FAST, move_a_native_session, restored_frames, stream
from tests.e2e.waits import until

PLUGIN = "harness.frame_models:EchoFramePlugin"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["drain", "failover"])
async def test_a_native_session_keeps_its_models_memory_when_its_worker_goes(redis_server, how):
    written, frames = await move_a_native_session(
        redis_server.url,
        how,
        plugin=PLUGIN,
        model="frame_echo",
        record_bytes=4,
    )
    steps = np.frombuffer(written, "<u4")
    # 1, 2, 3, ...: the restored slot counted on from its history, nothing lost or twice
    assert (np.diff(steps) == 1).all() and steps[0] == 1
    assert len(steps) > frames


async def test_a_native_session_keeps_its_memory_across_a_same_id_restart(redis_server):
    """The worker killed and started again under its id before its heartbeat expires (a
    StatefulSet pod): it takes the session back itself (`adopt`) from the checkpoint and
    the history as last written, and counts on from there."""
    prefix = f"native-restart-{uuid.uuid4().hex[:6]}"
    keys = KeySchema(prefix)
    port = free_port()
    env = {
        "DUPLEX_WORKER_HEALTH_PORT": str(port),
        "PYTHONPATH": CHECKOUT,
        "DUPLEX_HEARTBEAT_INTERVAL_S": "0.2",
        "DUPLEX_HEARTBEAT_TTL_S": "60",  # the restart, not the sweep, takes it back
    }
    worker = start_worker(redis_server.url, prefix, "w-a", PLUGIN, **env)
    api = start_api(redis_server.url, prefix, "restart-api", **FAST)
    handle = connect(redis_server.url)
    redis = handle.client
    stop = asyncio.Event()
    client = RecordingClient([api.base], heartbeat_s=None)
    tasks: list[asyncio.Task[None]] = []
    try:
        api.wait_ready()
        await until(lambda: redis.zcard(keys.workers()), lambda n: n >= 1, 60)
        await client.connect({"model": "frame_echo"})
        tasks += [asyncio.create_task(drain(client)), asyncio.create_task(stream(client, stop))]
        sid = client.session_id
        history = keys.model_history(sid)
        await until(lambda: redis.strlen(history), lambda n: n >= 4 * 25)
        worker.process.send_signal(signal.SIGKILL)
        worker.process.wait()
        worker = start_worker(redis_server.url, prefix, "w-a", PLUGIN, **env)
        await until(lambda: redis.hget(keys.session(sid), "owner_generation"), lambda g: g == b"2")
        frames = await until(
            lambda: asyncio.to_thread(restored_frames, port, "frame_echo"), lambda n: n >= 25
        )
        written = await until(lambda: redis.get(history), lambda d: len(d) > frames * 4 + 40)
        steps = np.frombuffer(written, "<u4")
        assert (np.diff(steps) == 1).all() and steps[0] == 1
        assert [f for f in client.delivered if f.get("type") == "error"] == []
        assert client.ended is None
    finally:
        stop.set()
        await client.close(end_session=False)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        api.stop()
        worker.stop()
        await handle.close()
