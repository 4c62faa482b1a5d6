"""The FrameModel contract (tests/contracts/frame_model_suite.py) over the tiny MiniCPM-o 4.5
(MiniCPMOFrameModel, built by plugins/minicpmo/builder.py, greedy), in .venv-minicpmo.

Its records hold every input of a unit (the audio, the camera frames) and every decision
(the fed tokens, the codes), so everything after a restore is exactly the original's: the
voice too (the open turn's codes are rendered again through the vocoder)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from plugins.minicpmo import MiniCPMOPlugin
from plugins.minicpmo.frame_model import MiniCPMOFrameModel
from shared.contracts import FrameModel, FrameOutput
from tests.contracts.frame_model_suite import FrameModelContract, FrameSubject, Observation

RATE = 16_000


def jpeg(seed: int, index: int) -> bytes:
    pixels = np.random.default_rng((seed, index)).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=80)
    return out.getvalue()


class MiniCPMOSubject(FrameSubject):
    frames = 6

    def __init__(self, model_dir: str) -> None:
        super().__init__()
        self.model_dir = model_dir

    def make(self, slots: int) -> MiniCPMOFrameModel:
        options = {"model_dir": self.model_dir, "decode": "greedy", "replay_chunk_frames": "3"}
        model = MiniCPMOPlugin.from_options(options).frame_model(slots)
        assert isinstance(model, MiniCPMOFrameModel)
        return model

    def options(self, seed: int) -> dict[str, Any]:
        return {"system_prompt": f"you are assistant {seed}", "seed": seed}

    def frame(self, model: FrameModel, slot: int, seed: int, index: int) -> np.ndarray:
        """A gated tone over noise, its own per conversation, as 16-bit samples."""
        t = (np.arange(model.frame_samples) + index * model.frame_samples) / RATE
        gate = np.sin(2 * np.pi * 0.7 * t) > 0
        audio = 0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) * gate
        audio += 0.05 * np.random.default_rng((seed, index)).standard_normal(model.frame_samples)
        return (np.round(np.clip(audio, -1, 1) * 32767) / 32768).astype(np.float32)

    def images(self, model: FrameModel, slot: int, seed: int, index: int) -> tuple[bytes, ...]:
        return (jpeg(seed, index),) if index % 3 == 1 else ()

    def observe(self, model: FrameModel, slot: int, output: FrameOutput) -> Observation:
        return {
            "record": output.record,
            "audio": output.audio,
            "text": output.text,
            "speaking": output.speaking,
            "error": output.error,
        }

    def fail_next_step(self, model: FrameModel) -> str:
        """The camera path raises (a decoder out of memory): it runs before any slot's state
        moves, so nothing advanced."""
        assert isinstance(model, MiniCPMOFrameModel)
        engine = model.engine

        def broken(requests: Any) -> Any:
            del engine._frames  # the class's own again
            raise RuntimeError("out of memory")

        engine._frames = broken
        return "before"


@pytest.fixture(scope="module")
def subject(tiny_checkpoint) -> FrameSubject:
    return MiniCPMOSubject(str(tiny_checkpoint))


class TestMiniCPMOFrameModel(FrameModelContract):
    """The tiny MiniCPM-o 4.5 under the contract."""
