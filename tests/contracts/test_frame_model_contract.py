"""The FrameModel contract (tests/contracts/frame_model_suite.py) over the test models of
harness/frame_models.py, EchoFrameModel and ToolEchoFrameModel, and harness/unit_echo.py's
UnitEchoFrameModel (1 s units, camera frames, sized records), in the main venv."""

from __future__ import annotations

import numpy as np
import pytest

from harness import unit_echo
from harness.frame_models import RATE, EchoFrameModel, ToolEchoFrameModel
from shared.contracts import FrameModel, FrameOutput
from tests.contracts.frame_model_suite import FrameModelContract, FrameSubject, Observation


def tone(model: FrameModel, index: int, hz: float, amplitude: float) -> np.ndarray:
    """Frame `index` of a continuous tone."""
    t = (np.arange(model.frame_samples) + index * model.frame_samples) / RATE
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


class EchoSubject(FrameSubject):
    """A tone per conversation (its own pitch), quiet one frame in four (its own phase)."""

    restore_may_differ = {"audio": 2, "text": 2, "speaking": 2}
    restore_may_differ_why = (
        "its delay line (the input it has yet to say back, delay_frames = 2 frames) is in no "
        "record: a restored slot says silence for its first 2 frames, as after an interrupt"
    )
    interrupt_in_records = False
    interrupt_in_records_why = (
        "an interrupt empties its delay line only; its records are its step count"
    )

    def make(self, slots: int) -> EchoFrameModel:
        return EchoFrameModel(slots, delay_frames=2, replay_chunk_frames=5)

    def frame(self, model: FrameModel, slot: int, seed: int, index: int) -> np.ndarray:
        loud = (index + seed) % 4 != 3
        return tone(model, index, 200 + 60 * seed, 0.3 if loud else 0.0)

    def observe(self, model: FrameModel, slot: int, output: FrameOutput) -> Observation:
        return {
            "record": output.record,
            "audio": output.audio,
            "text": output.text,
            "speaking": output.speaking,
        }

    def fail_next_step(self, model: FrameModel) -> str:
        """Its step hook raises: before the model advanced (it has nothing in between)."""
        assert isinstance(model, EchoFrameModel)

        def broken() -> None:
            model.on_step = None
            raise RuntimeError("out of memory")

        model.on_step = broken
        return "before"


class ToolEchoSubject(FrameSubject):
    """A conversation has one tool (its own name) and hears two-frame tones every 6 frames,
    one in three high (a call held until an interrupt), the others low (a call, then quiet):
    it calls, waits for a result it never gets, and calls again only once interrupted."""

    def make(self, slots: int) -> ToolEchoFrameModel:
        return ToolEchoFrameModel(slots, answer_frames=3)

    def options(self, seed: int) -> dict:
        return {"tools": [{"type": "function", "name": f"tool_{seed}", "parameters": {}}]}

    def frame(self, model: FrameModel, slot: int, seed: int, index: int) -> np.ndarray:
        cycle, position = divmod(index, 6)
        hz = 880.0 if (cycle + seed) % 3 == 0 else 440.0
        return tone(model, index, hz, 0.3 if position in (1, 2) else 0.0)

    def observe(self, model: FrameModel, slot: int, output: FrameOutput) -> Observation:
        return {
            "audio": output.audio,
            "text": output.text,
            "speaking": output.speaking,
            "calls": tuple((call.name, call.arguments) for call in output.function_calls),
            "error": output.error,
        }


class UnitEchoSubject(FrameSubject):
    """1 s units of a tone of the conversation's own pitch, quiet one unit in three (its own
    phase), and a camera frame (a JPEG's first bytes and a body of the conversation's, of
    its own length) with every other unit: records of three sizes, the images in them.
    Exact after a restore: the audio it is about to say is in the last record."""

    frames = 8

    def make(self, slots: int) -> unit_echo.UnitEchoFrameModel:
        return unit_echo.UnitEchoFrameModel(slots, replay_chunk_frames=3)

    def frame(self, model: FrameModel, slot: int, seed: int, index: int) -> np.ndarray:
        loud = (index + seed) % 3 != 2
        t = (np.arange(model.frame_samples) + index * model.frame_samples) / unit_echo.RATE
        return ((0.3 if loud else 0.0) * np.sin(2 * np.pi * (200 + 60 * seed) * t)).astype(
            np.float32
        )

    def images(self, model: FrameModel, slot: int, seed: int, index: int) -> tuple[bytes, ...]:
        if (index + seed) % 2:
            return ()
        return (b"\xff\xd8\xff" + bytes([seed, index % 256]) * (20 + 7 * index),)

    def observe(self, model: FrameModel, slot: int, output: FrameOutput) -> Observation:
        return {
            "record": output.record,
            "audio": output.audio,
            "text": output.text,
            "speaking": output.speaking,
            "error": output.error,
        }

    def fail_next_step(self, model: FrameModel) -> str:
        """Its step hook raises: before the model advanced."""
        assert isinstance(model, unit_echo.UnitEchoFrameModel)

        def broken() -> None:
            model.on_step = None
            raise RuntimeError("out of memory")

        model.on_step = broken
        return "before"


@pytest.fixture(
    scope="module",
    params=[EchoSubject, ToolEchoSubject, UnitEchoSubject],
    ids=lambda c: c.__name__,
)
def subject(request) -> FrameSubject:
    return request.param()


class TestFrameModelContract(FrameModelContract):
    """EchoFrameModel, ToolEchoFrameModel and UnitEchoFrameModel under the contract."""
