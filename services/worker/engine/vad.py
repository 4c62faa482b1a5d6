"""Server VAD: Silero's ONNX model behind a small detector with OpenAI server_vad semantics.

One `SileroOnnxBackend` (one ONNX session) per worker is shared by every
session; each session owns a `ServerVadDetector` with its own recurrent state.
The detector runs on the manager's executor, called by the session's input task
(`InputQueue`) in append order.

`semantic_vad` is the same detector with another rule for how much silence ends a turn:
the verdict of the latest partial transcript (`semantic_turn.py`), handed in with
`set_hint` by the session's runner (through `InputPipeline`, without its lock: one
attribute write, read once per frame by `silence_limit_ms`).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.util
import os
import threading

import numpy as np

from services.worker.engine.semantic_turn import (
    PAUSE_PROBE_MS,
    UNDECIDED,
    TurnHint,
    silence_needed_ms,
)
from shared.contracts import TurnDetection
from shared.protocol.duplex import SEMANTIC_VAD

SAMPLE_RATE_HZ = 16_000
FRAME_SAMPLES = 512  # 32 ms at 16 kHz: Silero's frame
CONTEXT_SAMPLES = 64
FRAME_MS = FRAME_SAMPLES * 1000 // SAMPLE_RATE_HZ
#: Speech ends below `threshold - NEGATIVE_MARGIN` (Silero's hysteresis), never below 0.01.
NEGATIVE_MARGIN = 0.15


class VadUnavailable(RuntimeError):
    """The VAD model could not be loaded (code `server_vad_unavailable`)."""


class VadStream(abc.ABC):
    """Per-session recurrent state of a VAD model."""

    @abc.abstractmethod
    def probability(self, frame: np.ndarray) -> float:
        """Speech probability of one FRAME_SAMPLES frame at 16 kHz."""


class VadBackend(abc.ABC):
    @abc.abstractmethod
    def new_stream(self) -> VadStream: ...


def silero_model_path() -> str:
    """`silero_vad/data/silero_vad.onnx`, located without importing the package
    (its `__init__` imports torch, which we do not install)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise VadUnavailable(
            "the silero-vad package is not installed (pip install --no-deps silero-vad)"
        )
    path = os.path.join(spec.submodule_search_locations[0], "data", "silero_vad.onnx")
    if not os.path.exists(path):
        raise VadUnavailable(f"silero VAD model not found at {path}")
    return path


class SileroOnnxBackend(VadBackend):
    """Silero VAD v5/v6 ONNX: input [1, 576] = 64 context + 512 new samples, state [2, 1, 128]."""

    _shared: SileroOnnxBackend | None = None
    _lock = threading.Lock()

    def __init__(self, model_path: str | None = None) -> None:
        try:
            import onnxruntime
        except ImportError as exc:  # pragma: no cover - onnxruntime is a dependency
            raise VadUnavailable(f"onnxruntime is not installed: {exc}") from exc
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1  # many small frames: threads cost more than they give
        options.inter_op_num_threads = 1
        try:
            self.session = onnxruntime.InferenceSession(
                model_path or silero_model_path(),
                sess_options=options,
                providers=["CPUExecutionProvider"],
            )
        except VadUnavailable:
            raise
        except Exception as exc:
            raise VadUnavailable(f"cannot load the VAD model: {exc}") from exc
        self.rate = np.array(SAMPLE_RATE_HZ, dtype=np.int64)

    @classmethod
    def shared(cls, model_path: str | None = None) -> SileroOnnxBackend:
        """The worker's one backend (loading the model once)."""
        with cls._lock:
            if cls._shared is None:
                cls._shared = cls(model_path)
            return cls._shared

    def new_stream(self) -> VadStream:
        return _SileroStream(self)


class _SileroStream(VadStream):
    def __init__(self, backend: SileroOnnxBackend) -> None:
        self.backend = backend
        self.state = np.zeros((2, 1, 128), np.float32)
        self.context = np.zeros(CONTEXT_SAMPLES, np.float32)

    def probability(self, frame: np.ndarray) -> float:
        x = np.concatenate([self.context, frame]).astype(np.float32)[None, :]
        out, self.state = self.backend.session.run(
            None, {"input": x, "state": self.state, "sr": self.backend.rate}
        )
        self.context = x[0, -CONTEXT_SAMPLES:]
        return float(out[0, 0])


@dataclasses.dataclass(frozen=True)
class VadEvent:
    #: "started" | "stopped" | "paused" (semantic_vad: PAUSE_PROBE_MS of silence inside
    #: speech, reported at the end of the last speech frame, so a transcript is asked for)
    kind: str
    audio_ms: int  # session-relative: audio_start_ms or audio_end_ms


class ServerVadDetector:
    """Speech start/stop over one session's 16 kHz stream.

    Start: `min_speech_duration_ms` of frames at or above `threshold`, reported
    `prefix_padding_ms` before the first of them. Stop: `silence_duration_ms`
    of frames below the negative threshold, reported at the end of the last
    speech frame; under semantic_vad, the silence `semantic_turn` asks for.
    """

    def __init__(self, backend: VadBackend, settings: TurnDetection, start_ms: int = 0) -> None:
        self.settings = settings
        self.stream = backend.new_stream()
        self.pending = np.zeros(0, np.float32)
        self.position_ms = start_ms  # stream time of the next frame's start
        self.in_speech = False
        self.run_start_ms: int | None = None
        self.run_ms = 0
        self.silence_ms = 0
        self.last_speech_end_ms = 0
        self.semantic = settings.type == SEMANTIC_VAD
        self.hint: TurnHint | None = None
        self.probed = False  # this pause has been reported ("paused")

    def set_hint(self, hint: TurnHint) -> None:
        """The latest partial transcript's verdict (semantic_vad only)."""
        self.hint = hint

    def silence_limit_ms(self) -> float:
        """The silence that ends the current turn."""
        if not self.semantic:
            return self.settings.silence_duration_ms
        hint = self.hint
        # a transcript decoded before the last speech frame misses the words that matter
        fresh = hint is not None and hint.covers_ms >= self.last_speech_end_ms
        verdict = hint.verdict if fresh and hint is not None else UNDECIDED
        return silence_needed_ms(
            self.settings.eagerness, self.settings.silence_duration_ms, verdict
        )

    @property
    def negative_threshold(self) -> float:
        return max(self.settings.threshold - NEGATIVE_MARGIN, 0.01)

    def process(self, audio: np.ndarray) -> list[VadEvent]:
        """Feed 16 kHz float32 samples; returns the speech events they complete."""
        samples = np.concatenate([self.pending, audio]) if self.pending.size else audio
        usable = len(samples) - len(samples) % FRAME_SAMPLES
        self.pending = samples[usable:].copy()
        events: list[VadEvent] = []
        for start in range(0, usable, FRAME_SAMPLES):
            event = self._frame(self.stream.probability(samples[start : start + FRAME_SAMPLES]))
            if event is not None:
                events.append(event)
        return events

    def _frame(self, probability: float) -> VadEvent | None:
        frame_start, frame_end = self.position_ms, self.position_ms + FRAME_MS
        self.position_ms = frame_end
        if not self.in_speech:
            if probability < self.settings.threshold:
                self.run_start_ms, self.run_ms = None, 0
                return None
            if self.run_start_ms is None:
                self.run_start_ms = frame_start
            self.run_ms += FRAME_MS
            if self.run_ms < self.settings.min_speech_duration_ms:
                return None
            self.in_speech, self.silence_ms, self.last_speech_end_ms = True, 0, frame_end
            self.hint, self.probed = None, False
            start = max(0, self.run_start_ms - int(self.settings.prefix_padding_ms))
            self.run_start_ms, self.run_ms = None, 0
            return VadEvent("started", start)
        if probability >= self.negative_threshold:
            self.silence_ms, self.last_speech_end_ms, self.probed = 0, frame_end, False
            return None
        self.silence_ms += FRAME_MS
        if self.silence_ms < self.silence_limit_ms():
            if self.semantic and not self.probed and self.silence_ms >= PAUSE_PROBE_MS:
                self.probed = True
                return VadEvent("paused", self.last_speech_end_ms)
            return None
        self.in_speech, self.hint = False, None
        return VadEvent("stopped", self.last_speech_end_ms)
