"""A model-native session keeps its model's memory when its worker goes (SIGTERM: a drain,
SIGKILL: a failover), with the echo frame model: its memory is its step count, each
frame's record the step number, so the history the new worker writes must count on from
the frames it restored. The scenario and its checks: tests/e2e/native_moves.py."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from tests.e2e.native_moves import move_a_native_session


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["drain", "failover"])
async def test_a_native_session_keeps_its_models_memory_when_its_worker_goes(redis_server, how):
    written, frames = await move_a_native_session(
        redis_server.url,
        how,
        plugin="harness.frame_models:EchoFramePlugin",
        model="frame_echo",
        record_bytes=4,
    )
    steps = np.frombuffer(written, "<u4")
    # 1, 2, 3, ...: the restored slot counted on from its history, nothing lost or twice
    assert (np.diff(steps) == 1).all() and steps[0] == 1
    assert len(steps) > frames
