"""The Moshi plugin's tests, on the tiny random checkpoint of harness/tiny_moshi.py.

Runs only where torch and `moshi` are installed (`make test-moshi` builds `.venv-moshi`);
tests/plugins/conftest.py leaves this folder out elsewhere. Greedy decoding throughout: moshi
samples with torch's global generator over the whole batch, which is not batch-invariant.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from harness.processes import HttpProcess, Process, start_api, start_worker, wait_worker_ready
from harness.redis_server import free_port
from harness.tiny_moshi import make_tiny_moshi
from plugins.moshi import MoshiPlugin

GREEDY = {"device": "cpu", "temperature": "0", "temperature_text": "0", "threads": "1"}
#: GREEDY as a worker's DUPLEX_PLUGIN_OPTIONS
GREEDY_OPTIONS = ",".join(f"{key}={value}" for key, value in GREEDY.items())


@contextlib.contextmanager
def moshi_stack(
    redis_url: str, model_dir: Path, name: str
) -> Iterator[tuple[HttpProcess, int, Process]]:
    """`duplex worker --plugin moshi` (greedy, 2 slots) on `model_dir` and `duplex api`, as
    real processes on `redis_url`, ready: (the API pod, the worker's health port, the
    worker); both stopped at the end."""
    prefix = f"duplex-{name}-{uuid.uuid4().hex[:8]}"
    health = free_port()
    worker = start_worker(
        redis_url,
        prefix,
        "moshi-worker",
        "moshi",
        DUPLEX_MODEL_DIR=str(model_dir),
        DUPLEX_PLUGIN_OPTIONS=GREEDY_OPTIONS,
        DUPLEX_MAX_SESSIONS="2",
        DUPLEX_WORKER_HEALTH_PORT=str(health),
        HF_HUB_OFFLINE="1",
    )
    api = start_api(redis_url, prefix, "moshi-api")
    try:
        wait_worker_ready(worker, health, 120)
        api.wait_ready()
        yield api, health, worker
    finally:
        api.stop()
        worker.stop()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_moshi(tmp_path_factory.mktemp("tiny-moshi"))


@pytest.fixture
def make_model(tiny_dir):
    """`make_model(slots)`: a fresh greedy MoshiFrameModel on the tiny checkpoint."""

    def make(slots: int, **options: str):
        plugin = MoshiPlugin.from_options({"model_dir": str(tiny_dir), **GREEDY, **options})
        return plugin.frame_model(slots)

    return make


def user_audio(seed: int, frames: int) -> np.ndarray:
    """`frames` frames of noise-like user audio [frames, 1920], different per seed."""
    rng = np.random.default_rng(seed)
    return (0.2 * rng.standard_normal((frames, 1920))).astype(np.float32)
