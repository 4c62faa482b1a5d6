"""The slow half of input handling: decode, resample, speech verdict, VAD.

Called by the session's one input task (`InputQueue`), one append at a time, in
append order, on the event loop or the manager's executor. A lock guards the
resampler and VAD state all the same: the runner's task resets and reconfigures
them (input clear and cancel, session.update) while a conversion may be running
on the executor, and a stopped input task leaves its executor call running.

`set_turn_hint` alone takes no lock: it comes from the runner's task for every partial
transcript, and waiting there for a long conversion (thousands of VAD frames) would stall
the worker's event loop. It is one attribute write, atomic under the GIL, and the
detector reads the hint once per frame (`ServerVadDetector.silence_limit_ms`), so a hint
arriving mid-append counts from the next frame.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from services.worker.engine.semantic_turn import TurnHint
from services.worker.engine.vad import ServerVadDetector, VadBackend, VadEvent
from shared.contracts import TurnDetection
from shared.protocol.duplex import (
    AppendAudio,
    DuplexInputConverter,
    RealtimeProtocolError,
    decode_audio,
    estimate_decoded_samples,
    speech_verdict,
)


@dataclasses.dataclass(frozen=True)
class ConvertedAppend:
    samples: np.ndarray  # mono float32 at the model input rate
    speech: bool
    vad_events: list[VadEvent]


class InputPipeline:
    def __init__(self, input_rate_hz: int, vad_backend: Callable[[], VadBackend] | None) -> None:
        self.input_rate_hz = input_rate_hz
        self._vad_backend = vad_backend
        self._lock = threading.Lock()
        self._converter = DuplexInputConverter(input_rate_hz)
        self._detector: ServerVadDetector | None = None

    @property
    def has_vad(self) -> bool:
        return self._detector is not None

    def decoded_samples(self, command: AppendAudio) -> int:
        """Samples the append's audio becomes at the model input rate, from its length and
        declared rate or WAV header, without decoding; raises `unsupported_audio_format`
        (or `bad_audio`) for a header that would not decode."""
        return estimate_decoded_samples(command.audio, command.audio_format, self.input_rate_hz)

    def runs_inline(self, command: AppendAudio) -> bool:
        """Whether converting this append is cheaper than handing it to a thread: without
        VAD a small append is a decode and a short resample (tens of microseconds), while
        the executor round trip and the GIL hand-off cost more than that (bench/profile,
        `--load realtime`: ThreadPoolExecutor.submit alone was 4% of the worker).

        Both ends are bounded: the payload (decode work) and the resampled output
        (resample work and memory). Payload size alone let a 6 KB WAV declaring 1 Hz
        resample to 48 M samples on the event loop."""
        if self._detector is not None or len(command.audio) > INLINE_MAX_BYTES:
            return False
        try:
            return self.decoded_samples(command) <= INLINE_MAX_SAMPLES
        except RealtimeProtocolError:
            return True  # refused by the header check before any decode: cheap inline

    def configure_vad(self, settings: TurnDetection | None, stream_ms: int) -> None:
        """(Re)build the detector when turn detection changes; None turns it off. A new
        `idle_timeout_ms` alone keeps it (the idle timer is not the detector's): a
        session.update that only sets it must not forget the speech under way."""
        with self._lock:
            if settings is None or self._vad_backend is None:
                self._detector = None
            elif self._detector is None or _detection(self._detector.settings) != _detection(
                settings
            ):
                self._detector = ServerVadDetector(
                    self._vad_backend(), settings, start_ms=stream_ms
                )
            else:
                self._detector.settings = settings

    def set_turn_hint(self, hint: TurnHint) -> None:
        """semantic_vad: the verdict of the latest partial transcript (`semantic_turn`).
        Without the lock, on the event loop (module docstring)."""
        detector = self._detector  # read once: a reset may replace it meanwhile
        if detector is not None:
            detector.set_hint(hint)

    def reset(self, stream_ms: int) -> None:
        """Input clear: forget the resampler's history and restart VAD at `stream_ms`."""
        with self._lock:
            self._converter.reset()
            if self._detector is not None:
                self._detector = ServerVadDetector(
                    self._vad_backend(), self._detector.settings, start_ms=stream_ms
                )

    def convert(self, command: AppendAudio, silence_rms: float) -> ConvertedAppend:
        # hot path: every audio frame of every session passes here
        with self._lock:
            decoded, rate = (
                decode_audio(command.audio, command.audio_format) if command.audio else (_EMPTY, 0)
            )
            samples = self._converter.resample(decoded, rate) if command.audio else _EMPTY
            speech = speech_verdict(  # RMS is measured on the decoded input, before resampling
                is_speech=command.is_speech,
                hints=command.hints,
                encoding=command.format,
                samples=decoded if command.format == "pcm_f32le" else None,
                silence_rms=silence_rms,
            )
            events = (
                self._detector.process(samples)
                if self._detector is not None and samples.size
                else []
            )
        return ConvertedAppend(samples, speech, events)

    def flush(self) -> np.ndarray:
        """The resampler's held-back samples, at a commit (also fed to VAD)."""
        with self._lock:
            return self._converter.flush()


def _detection(settings: TurnDetection) -> TurnDetection:
    """The settings that matter to the detector."""
    return dataclasses.replace(settings, idle_timeout_ms=None)


_EMPTY = np.zeros(0, np.float32)
INLINE_MAX_BYTES = 8 * 1024  # payload: 256 ms of pcm16 at 16 kHz
INLINE_MAX_SAMPLES = 4096  # output: 256 ms at 16 kHz, 16 KiB of float32
