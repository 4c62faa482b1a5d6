"""A model-native session keeps its model's memory when its worker goes (SIGTERM: a drain,
SIGKILL: a failover; a restart under the same id), with the echo frame model: its memory
is its step count, each frame's record the step number, so the history the new worker
writes must count on from the frames it restored. The move scenario and its checks:
tests/e2e/native_moves.py."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from tests.e2e.native_moves import NativeFleet, move_a_native_session
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
    # a long heartbeat TTL: the restart, not the dead-worker sweep, takes the session back
    fleet = NativeFleet(redis_server.url, ["w-a"], PLUGIN, DUPLEX_HEARTBEAT_TTL_S="60")
    try:
        sid = await fleet.open("frame_echo", record_bytes=4)
        fleet.workers["w-a"].process.send_signal(signal.SIGKILL)
        fleet.restart("w-a")
        session = fleet.keys.session(sid)
        await until(lambda: fleet.redis.hget(session, "owner_generation"), lambda g: g == b"2")
        frames = await fleet.restored("w-a", "frame_echo")
        history = fleet.keys.model_history(sid)
        written = await until(lambda: fleet.redis.get(history), lambda d: len(d) > frames * 4 + 40)
        steps = np.frombuffer(written, "<u4")
        assert (np.diff(steps) == 1).all() and steps[0] == 1
        fleet.check_no_error_and_contiguous()
    finally:
        await fleet.close()
