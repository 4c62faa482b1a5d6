"""The FrameModel contract (tests/contracts/frame_model_suite.py) over the tiny Nemotron
VoiceChat (NemotronFrameModel on harness/tiny_nemotron.py's checkpoint), in .venv-nemotron.

Its records hold everything its state is made of (the frame's audio, tokens, codes, the
tool-result tokens fed before it, a barge-in), so nothing may differ after a restore: the
speech within 1e-5 (NeMo's incremental codec decoding over the restored codes), the rest
exactly. A conversation opens with a system prompt of its own, replayed in one forward.
Two checkpoints: the tiny one, and one whose speech decoder has a sliding window."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from harness.tiny_nemotron import build_tiny_checkpoint
from plugins.nemotron import NemotronPlugin
from plugins.nemotron.frame_model import NemotronFrameModel
from plugins.nemotron.tools import render_system_prompt
from shared.contracts import FrameModel, FrameOutput
from tests.contracts.frame_model_suite import FrameModelContract, FrameSubject, Observation
from tests.plugins.nemotron.conftest import OPTIONS

RATE = 16_000


class NemotronSubject(FrameSubject):
    frames = 10
    #: the FastConformer's left context (harness/tiny_nemotron.py: att_context_size [16, 0],
    #: one encoder step a frame)
    context_frames = 16
    atol = 1e-5
    prompt_in_one_piece = True

    def __init__(self, model_dir: str) -> None:
        super().__init__()
        self.model_dir = model_dir

    def make(self, slots: int) -> NemotronFrameModel:
        options = {"model_dir": self.model_dir, **OPTIONS, "replay_chunk_frames": "5"}
        return NemotronPlugin.from_options(options).frame_model(slots)

    def options(self, seed: int) -> dict[str, Any]:
        return {"system_prompt": render_system_prompt(f"you are assistant {seed}", []), "tools": []}

    def frame(self, model: FrameModel, slot: int, seed: int, index: int) -> np.ndarray:
        """A gated tone over noise, its own per conversation, as 16-bit samples."""
        samples = model.frame_samples
        t = (np.arange(samples) + index * samples) / RATE
        gate = np.sin(2 * np.pi * 0.7 * t) > 0
        audio = 0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) * gate
        audio += 0.1 * np.random.default_rng((seed, index)).standard_normal(samples)
        return (np.round(audio * 32768) / 32768).astype(np.float32)

    def observe(self, model: FrameModel, slot: int, output: FrameOutput) -> Observation:
        return {
            "record": output.record,
            "audio": output.audio,
            "text": output.text,
            "speaking": output.speaking,
            "calls": output.function_calls,
            "error": output.error,
        }

    def fail_next_step(self, model: FrameModel) -> str:
        """The codec's decoding raises, once: after every slot's tokens and codes."""
        assert isinstance(model, NemotronFrameModel)
        engine = model.engine

        def broken(*args: Any, **kwargs: Any) -> None:
            del engine.decode  # the class's own again
            raise RuntimeError("out of memory")

        engine.decode = broken
        return "advanced"


#: the speech decoder's sliding window of the second checkpoint (Gemma-3's mix of a
#: sliding-window layer and a full one), crossed by the suite's histories
SPEECH_WINDOW = 8


@pytest.fixture(scope="module", params=["plain", "speech-window"])
def subject(request, tiny_dir, tmp_path_factory) -> FrameSubject:
    """The tiny checkpoint, and one whose speech decoder has a sliding window the suite's
    histories run past (a restore rebuilds each layer's own cache)."""
    if request.param == "plain":
        return NemotronSubject(str(tiny_dir))
    directory = tmp_path_factory.mktemp("tiny-nemotron-window")
    return NemotronSubject(str(build_tiny_checkpoint(directory, speech_window=SPEECH_WINDOW)))


class TestNemotronFrameModel(FrameModelContract):
    """The tiny Nemotron VoiceChat under the contract."""
