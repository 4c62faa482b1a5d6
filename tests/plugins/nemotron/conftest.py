"""The Nemotron VoiceChat plugin's tests, on the tiny random checkpoint of
harness/tiny_nemotron.py (built here, once per run: nothing is downloaded).

Runs only where torch and nemo-toolkit are installed (`make test-nemotron` builds
`.venv-nemotron`); tests/plugins/conftest.py leaves this folder out elsewhere. The tiny checkpoint's
speech decoder is greedy (noise 0, top-1 mixture component), so every output is a function
of the input, whoever shares the batch.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from harness.tiny_nemotron import build_tiny_checkpoint
from plugins.nemotron import NemotronPlugin

OPTIONS = {"device": "cpu", "threads": "1"}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-nemotron"))


@pytest.fixture(scope="session")
def voicechat(tiny_dir):
    """NeMo's NemotronVoiceChat of the tiny checkpoint, loaded by our loader."""
    from plugins.nemotron.checkpoint import NemotronCheckpoint

    return NemotronCheckpoint.inspect(tiny_dir).load()


@pytest.fixture
def make_model(tiny_dir):
    """`make_model(slots, **options)`: a fresh NemotronFrameModel on the tiny checkpoint."""

    def make(slots: int, **options: str):
        plugin = NemotronPlugin.from_options({"model_dir": str(tiny_dir), **OPTIONS, **options})
        return plugin.frame_model(slots)

    return make


def user_audio(seed: int, frames: int) -> np.ndarray:
    """`frames` 80 ms frames of 16 kHz user audio [frames, 1280]: a gated tone over noise,
    different per seed (the tiny model says different things to different input)."""
    rng = np.random.default_rng(seed)
    t = np.arange(frames * 1280) / 16000
    tone = 0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) * (np.sin(2 * np.pi * 0.7 * t) > 0)
    audio = tone + 0.1 * rng.standard_normal(t.shape)
    # 16-bit samples, as a client's pcm16 reaches the model
    audio = np.round(audio * 32768) / 32768
    return audio.astype(np.float32).reshape(frames, 1280)
