"""The Moshi plugin's tests, on the tiny random checkpoint of harness/tiny_moshi.py.

Runs only where torch and `moshi` are installed (`make test-moshi` builds `.venv-moshi`);
tests/plugins/conftest.py leaves this folder out elsewhere. Greedy decoding throughout: moshi
samples with torch's global generator over the whole batch, which is not batch-invariant.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from harness.tiny_moshi import make_tiny_moshi
from plugins.moshi import MoshiPlugin

GREEDY = {"device": "cpu", "temperature": "0", "temperature_text": "0", "threads": "1"}


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
