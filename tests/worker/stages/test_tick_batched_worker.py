"""A worker serving a frame-clocked plugin: the model is loaded at start, its slots bound
admission (registration and manager), and the tick's metrics are on the worker's registry."""

from __future__ import annotations

import uuid

import pytest

from harness.frame_models import EchoFramePlugin
from services.worker.plugins import KNOWN_PLUGINS
from services.worker.process import WorkerProcess
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from shared.settings import WorkerSettings

PLUGIN = "harness.frame_models:EchoFramePlugin"


async def test_a_frame_clocked_worker_admits_by_the_model_slots(redis_server):
    prefix = f"tick-{uuid.uuid4().hex[:6]}"
    handle = connect(redis_server.url)
    settings = WorkerSettings(
        worker_id="wf",
        plugin=PLUGIN,
        max_sessions=8,
        key_prefix=prefix,
        extra_plugin_options={"slots": "3"},
    )
    worker = WorkerProcess(settings, handle)
    assert isinstance(worker.plugin, EchoFramePlugin) and worker.plugin.slots == 3
    with pytest.raises(RuntimeError):  # the model loads in start(), off the event loop
        _ = worker.manager
    await worker.start()
    try:
        port = worker.manager.builder.port
        assert isinstance(port, TickBatchedStagePort) and port.model.slots == 3
        assert worker.runtime.max_sessions == 3
        info = await handle.client.hgetall(KeySchema(prefix).worker("wf"))
        assert info[b"model"] == b"frame_echo" and info[b"max_sessions"] == b"3"
        text = worker.metrics.render().decode()
        assert 'duplex_tick_slots{model="frame_echo"} 3.0' in text
    finally:
        await worker.stop()
    assert port.model.closed  # the worker's stop shut the stage and the model down
    await handle.close()


def test_moshi_is_a_known_plugin():
    assert KNOWN_PLUGINS["moshi"] == "plugins.moshi:MoshiPlugin"
