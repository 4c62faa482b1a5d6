"""`MiniCPMOFrameModel`: MiniCPM-o 4.5 behind the worker's frame-model contract.

Its frame is the model's unit: one second of 16 kHz audio (16,000 samples), with the
camera frames the client sent with it (at most `MAX_IMAGES_PER_UNIT`, JPEG or PNG). The
tick stage steps every open slot once a second, in one batched step (engine.py); the
model answers with 24 kHz audio (one second, or silence when it listens), its words, and
the unit's state record, whose size varies with what the unit fed and saw (the "sized"
record layout: `state_records_sized`).

A slot's options (the plugin's `prepare_runtime_config`, checkpointed with the session):
`system_prompt` (the text the demo server and vLLM-Omni frame as
`<|im_start|>system\\n{prompt}\\n<|audio_start|>` ... `<|audio_end|><|im_end|>`), `voice`
(a reference voice, 16 kHz pcm16 in base64, fed between the two as the reference feeds
its `ref_audio`) and `seed` (every unit's draws are seeded by it and the unit's index, so a
session restored elsewhere draws what it would have drawn).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from plugins.minicpmo.duplex_loop import Prompt
from plugins.minicpmo.engine import EngineSettings, UnitEngine, UnitRequest
from plugins.minicpmo.model import MiniCPMOWeights
from plugins.minicpmo.records import UNIT_SAMPLES, RecordError, UnitRecord
from plugins.minicpmo.vocoder import OUTPUT_RATE, CodecDecoder
from shared.contracts.frame_model import FrameModel, FrameOutput
from shared.contracts.images import ImageInput
from shared.contracts.model_history import split_records

#: camera frames a unit takes: one a second is what the model was trained on (the demo
#: sends one per unit) and what vLLM-Omni attaches; the stage keeps the newest
MAX_IMAGES_PER_UNIT = 1
#: an encoded camera frame's bytes (a 1080p JPEG is 0.1-0.5 MB)
MAX_IMAGE_BYTES = 2 * 1024 * 1024
#: the largest record: the fixed part of a speaking unit (32,134 bytes) and its frames
MAX_RECORD_BYTES = 32_134 + MAX_IMAGES_PER_UNIT * (4 + MAX_IMAGE_BYTES)
#: the prompt when the session gives no instructions (vLLM-Omni's default)
DEFAULT_SYSTEM_PROMPT = "Streaming Omni Conversation."
PROMPT_PREFIX = "<|im_start|>system\n{prompt}\n<|audio_start|>"
PROMPT_SUFFIX = "<|audio_end|><|im_end|>"


class MiniCPMOFrameModel(FrameModel):
    frame_samples = UNIT_SAMPLES
    input_sample_rate_hz = 16_000
    output_sample_rate_hz = OUTPUT_RATE
    state_record_bytes = MAX_RECORD_BYTES
    state_records_sized = True
    image_input = ImageInput(max_per_frame=MAX_IMAGES_PER_UNIT, max_bytes=MAX_IMAGE_BYTES)

    def __init__(
        self,
        weights: MiniCPMOWeights,
        decoder: CodecDecoder,
        settings: EngineSettings,
        *,
        replay_chunk_frames: int = 32,
    ) -> None:
        self.slots = settings.slots
        self.replay_chunk_frames = replay_chunk_frames
        self.engine = UnitEngine(weights, decoder, settings)
        self._open = [False] * self.slots
        self._barge_in = [False] * self.slots

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is out of range (0..{self.slots - 1})")

    def _prompt(self, options: Mapping[str, Any]) -> Prompt:
        prompt = str(options.get("system_prompt") or DEFAULT_SYSTEM_PROMPT)
        voice = None
        if options.get("voice"):  # 16 kHz pcm16, base64 (the plugin's read_reference_voice)
            pcm = np.frombuffer(base64.b64decode(options["voice"]), dtype="<i2")
            voice = pcm.astype(np.float32) / 32768.0
        return self.engine.prompt(PROMPT_PREFIX.format(prompt=prompt), PROMPT_SUFFIX, voice)

    @staticmethod
    def _seed(options: Mapping[str, Any]) -> int:
        return int(options.get("seed") or 0)

    def open_slot(self, slot: int, options: Mapping[str, Any]) -> None:
        self._check_slot(slot)
        self.engine.open(slot, self._prompt(options), seed=self._seed(options))
        self._open[slot] = True
        self._barge_in[slot] = False

    def restore_slot(self, slot: int, options: Mapping[str, Any], history: bytes) -> None:
        self._check_slot(slot)
        try:
            records = [
                UnitRecord.decode(data)
                for data in split_records(history, self.state_record_bytes, sized=True)
            ]
        except (RecordError, ValueError) as exc:
            raise ValueError(f"a MiniCPM-o history that is not unit records: {exc}") from None
        self.engine.begin_restore(
            slot, self._prompt(options), seed=self._seed(options), records=records
        )
        self._open[slot] = True
        self._barge_in[slot] = False

    def replay_pending(self, slot: int) -> int:
        return self.engine.replay_left(slot)

    def replay_work(self, slot: int, frames: int) -> int:
        if not 1 <= frames <= self.replay_chunk_frames:
            raise ValueError(
                f"replay_work takes 1..{self.replay_chunk_frames} units a call, not {frames}"
            )
        return self.engine.replay(slot, frames)

    def interrupt_slot(self, slot: int) -> None:
        """Barge-in: the slot's next unit closes its open turn and listens (engine.py)."""
        self._check_slot(slot)
        self._barge_in[slot] = True

    def close_slot(self, slot: int) -> None:
        self._check_slot(slot)
        self.engine.close(slot)
        self._open[slot] = False

    def step(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> list[FrameOutput | None]:
        active = self.checked_active(frames, active, images)
        slots = [int(s) for s in np.flatnonzero(active)]
        for slot in slots:
            if not self._open[slot]:
                raise ValueError(f"slot {slot} is not open")
            if self.engine.replay_left(slot):
                raise ValueError(f"slot {slot} is still replaying its history")
        requests = []
        for slot in slots:
            requests.append(
                UnitRequest(
                    slot,
                    frames[slot],
                    images[slot] if images is not None else (),
                    force_listen=self._barge_in[slot],
                )
            )
            self._barge_in[slot] = False
        results: list[FrameOutput | None] = [None] * self.slots
        for outcome in self.engine.step(requests):
            results[outcome.slot] = FrameOutput(
                audio=outcome.audio,
                text=outcome.text,
                speaking=not outcome.listen,
                record=outcome.record.encode(),
                error=outcome.error,
            )
        return results


__all__ = ["MAX_IMAGES_PER_UNIT", "MAX_IMAGE_BYTES", "MiniCPMOFrameModel"]
