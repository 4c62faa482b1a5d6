"""From codec tokens to the model's voice: 25 Hz codes in, 24 kHz audio out, streamed.

MiniCPM-o 4.5's vocoder is Step-Audio2's `Token2wav` (PyPI `minicpmo-utils`): flow
matching from codes to mel, then a causal HiFT vocoder. Its streaming contract, which the
duplex loop is written against:

- codes live in a 6561-code space at 25 Hz; each code is 960 samples at 24 kHz, so a
  unit's 25 codes are one second;
- a call that is not a stream's last must carry 3 codes of *lookahead* beyond the ones it
  renders (the flow model looks ahead), so a speaking unit renders the 25 codes before the
  newest 3, which wait for the next unit;
- the vocoder is causal with a delay: a stream's first rendered chunk starts with 3840
  samples of silence, and its last call (`last=True`) flushes what was held back.

`SpeechStream` is the duplex loop's side of it, the reference's rules: a turn starts with
three silence codes (4218) in the buffer; a turn's first unit flushes whatever it can
(chunks of up to 28 codes while at least 8 are buffered); later units render 25 codes per
28 buffered; a turn's end renders the rest with `last=True`; a chunk that is not a
stream's last and is shorter than a second is left-padded with silence to one second.

Backends (`CodecDecoder`): `Token2wavDecoder`, the real one, needs a CUDA GPU (the package
hard-codes `.cuda()`), its assets (`<model-dir>/assets/token2wav`) and a voice prompt (a
wav); `ToneDecoder` is a CPU stand-in with the same contract (a tone per code), which is
what a worker without a GPU speaks with: the words and the codes are the model's, the
sound is not.
"""

from __future__ import annotations

import abc
import math
from pathlib import Path
from typing import Any

import numpy as np

OUTPUT_RATE = 24000
SAMPLES_PER_CODE = 960
#: codes a non-final call carries beyond those it renders
LOOKAHEAD_CODES = 3
#: the causal vocoder's delay: silence before a stream's first chunk
VOCODER_DELAY_SAMPLES = 3840
#: the codec's silence, three of which open every turn's buffer
SILENCE_CODE = 4218
CODES_PER_UNIT = 25


class VocoderUnavailable(RuntimeError):
    """The vocoder asked for cannot run here (no GPU, its package or assets missing)."""


class CodecDecoder(abc.ABC):
    """Renders a stream of codes; one `new_stream()` state per turn of each slot."""

    @abc.abstractmethod
    def new_stream(self) -> Any:
        """A turn's fresh stream state (the voice prompt's caches, restored)."""

    @abc.abstractmethod
    def render(self, stream: Any, codes: list[int], *, last: bool) -> np.ndarray:
        """float32 mono at 24 kHz for `codes` (a non-final call: the ones before the last
        `LOOKAHEAD_CODES`, which it only looks at)."""


class SpeechStream:
    """One slot's buffer of codes between the speech model and the vocoder."""

    def __init__(self, decoder: CodecDecoder) -> None:
        self.decoder = decoder
        self.buffer: list[int] = []
        self.stream: Any = None

    def start_turn(self) -> None:
        self.stream = self.decoder.new_stream()
        self.buffer = [SILENCE_CODE] * LOOKAHEAD_CODES

    def drop(self) -> None:
        """A barge-in: what the turn had still to say is not said; the next speaking unit
        starts a new stream."""
        self.stream = None
        self.buffer = []

    def push(self, codes: list[int], *, first_unit: bool, end_of_turn: bool) -> np.ndarray:
        """The audio a unit's codes release (empty when they release none yet)."""
        if self.stream is None:
            self.start_turn()
        self.buffer += codes
        chunks: list[np.ndarray] = []
        window = CODES_PER_UNIT + LOOKAHEAD_CODES
        if first_unit:
            while len(self.buffer) >= LOOKAHEAD_CODES + 5:
                take = min(window, len(self.buffer))
                chunks.append(self.decoder.render(self.stream, self.buffer[:take], last=False))
                self.buffer = self.buffer[min(CODES_PER_UNIT, take - LOOKAHEAD_CODES) :]
        else:
            while len(self.buffer) >= window:
                chunks.append(self.decoder.render(self.stream, self.buffer[:window], last=False))
                self.buffer = self.buffer[CODES_PER_UNIT:]
        if end_of_turn and self.buffer:
            chunks.append(self.decoder.render(self.stream, self.buffer, last=True))
            self.buffer = []
        audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        if not end_of_turn and 0 < audio.size < OUTPUT_RATE:
            audio = np.concatenate([np.zeros(OUTPUT_RATE - audio.size, np.float32), audio])
        if end_of_turn:
            self.stream = None  # the next unit that speaks starts a new turn's stream
        return audio.astype(np.float32, copy=False)


class _ToneState:
    def __init__(self) -> None:
        self.held = np.zeros(VOCODER_DELAY_SAMPLES, np.float32)
        self.phase = 0.0


class ToneDecoder(CodecDecoder):
    """A CPU stand-in for Token2wav with its streaming contract: each code is 960 samples
    of a tone whose pitch the code picks (silence for the silence code), delayed by the
    vocoder's 3840 samples, flushed on the last call. Deterministic."""

    def new_stream(self) -> _ToneState:
        return _ToneState()

    def render(self, stream: _ToneState, codes: list[int], *, last: bool) -> np.ndarray:
        if not last and len(codes) <= LOOKAHEAD_CODES:
            raise ValueError("a non-final chunk needs fresh codes plus the lookahead")
        fresh = codes if last else codes[:-LOOKAHEAD_CODES]
        pieces = [stream.held]
        t = np.arange(SAMPLES_PER_CODE, dtype=np.float64) / OUTPUT_RATE
        for code in fresh:
            if code == SILENCE_CODE:
                pieces.append(np.zeros(SAMPLES_PER_CODE, np.float32))
                continue
            freq = 200.0 + 10.0 * (code % 64)
            wave = 0.1 * np.sin(2 * math.pi * freq * t + stream.phase)
            stream.phase = (stream.phase + 2 * math.pi * freq * SAMPLES_PER_CODE / OUTPUT_RATE) % (
                2 * math.pi
            )
            pieces.append(wave.astype(np.float32))
        audio = np.concatenate(pieces)
        if last:
            stream.held = np.zeros(0, np.float32)
            return audio
        stream.held = audio[-VOCODER_DELAY_SAMPLES:]
        return audio[:-VOCODER_DELAY_SAMPLES]


class Token2wavDecoder(CodecDecoder):
    """Step-Audio2's Token2wav (`minicpmo-utils`, the GPU extra), on a CUDA GPU, speaking
    with the voice of `prompt_wav`. One Token2wav serves every slot: each turn's stream
    holds its own copy of the prompt's caches, swapped in around each call (the package
    keeps one stream's caches on the object, and the reference restores them the same way
    at every turn)."""

    def __init__(self, model_dir: Path, prompt_wav: Path) -> None:
        try:
            import torch
            from stepaudio2 import Token2wav  # the GPU extra: minicpmo-utils
        except ImportError as exc:
            raise VocoderUnavailable(
                "the Token2wav vocoder needs the minicpmo-utils package (pip install "
                f"'duplex-serve[minicpmo-gpu]'): {exc}"
            ) from None
        if not torch.cuda.is_available():
            raise VocoderUnavailable(
                "the Token2wav vocoder runs on a CUDA GPU only (minicpmo-utils hard-codes "
                ".cuda()); without one, serve with --vocoder tone"
            )
        assets = Path(model_dir) / "assets" / "token2wav"
        if not assets.is_dir():
            raise VocoderUnavailable(f"{assets} is missing: the checkpoint's vocoder assets")
        if not Path(prompt_wav).is_file():
            raise VocoderUnavailable(f"the voice prompt {prompt_wav} is not a file")
        self._torch = torch
        self.prompt = str(prompt_wav)
        self.token2wav = Token2wav(str(assets))
        flow, hift = self.token2wav.set_stream_cache(self.prompt)
        self._base = (self._clone(flow), self._clone(hift))

    def _clone(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {key: self._clone(item) for key, item in value.items()}
        if isinstance(value, self._torch.Tensor):
            return value.clone()
        return value

    def new_stream(self) -> list[Any]:
        return [self._clone(self._base[0]), self._clone(self._base[1])]

    def render(self, stream: list[Any], codes: list[int], *, last: bool) -> np.ndarray:
        engine = self.token2wav
        engine.stream_cache, engine.hift_cache_dict = stream
        pcm = engine.stream(codes, prompt_wav=self.prompt, last_chunk=last)
        stream[0], stream[1] = engine.stream_cache, engine.hift_cache_dict
        return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


__all__ = [
    "CODES_PER_UNIT",
    "LOOKAHEAD_CODES",
    "OUTPUT_RATE",
    "SAMPLES_PER_CODE",
    "SILENCE_CODE",
    "VOCODER_DELAY_SAMPLES",
    "CodecDecoder",
    "SpeechStream",
    "Token2wavDecoder",
    "ToneDecoder",
    "VocoderUnavailable",
]
