"""Duplex audio: input conversion to the model rate, and the append's speech verdict.

Re-exports the Tier 1 audio helpers so duplex code imports audio from here
only; what differs for duplex (the 16 kHz model input rate) is decided here,
once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shared.protocol.realtime.audio import (
    InputAudioConverter,
    OutputAudioEncoder,
    StreamingResampler,
    WavHeader,
    alaw_to_int16,
    b64decode_audio,
    b64encode_audio,
    decode_audio,
    decode_wav,
    encode_audio,
    encode_wav,
    estimate_decoded_samples,
    f32le_to_float,
    float_to_f32le,
    float_to_int16,
    float_to_pcm16,
    int16_to_alaw,
    int16_to_ulaw,
    is_wav,
    parse_wav_header,
    pcm16_to_float,
    ulaw_to_int16,
)
from shared.protocol.realtime.formats import PCM_F32LE

#: Every input is converted to mono pcm_f32le at this rate before the model sees it.
DUPLEX_INPUT_RATE_HZ = 16_000
#: A VAD probability at or above this is speech.
SPEECH_PROBABILITY_THRESHOLD = 0.5


class DuplexInputConverter(InputAudioConverter):
    """One session's input converter: any input format -> 16 kHz float32 (or a plugin's rate)."""

    def __init__(self, target_rate: int = DUPLEX_INPUT_RATE_HZ) -> None:
        super().__init__(target_rate)


def rms(samples: np.ndarray) -> float:
    if samples.size == 0:
        return 0.0
    return float(np.sqrt(np.mean(np.square(samples, dtype=np.float64))))


def speech_verdict(
    *,
    is_speech: bool | None,
    hints: Mapping[str, Any],
    encoding: str,
    samples: np.ndarray | None,
    silence_rms: float,
) -> bool:
    """Whether an append carries speech, in the contract's order.

    An explicit boolean wins (`is_speech`, `speech`, `vad.is_speech`); then a
    VAD probability >= 0.5; then, for pcm_f32le only, RMS >= the silence RMS
    (per-event `vad.silence_rms` overrides the session's); otherwise speech.
    """
    vad = hints.get("vad") if isinstance(hints.get("vad"), Mapping) else {}
    for explicit in (is_speech, hints.get("speech"), vad.get("is_speech")):
        if isinstance(explicit, bool):
            return explicit
    for probability in (
        hints.get("speech_probability"),
        vad.get("speech_probability"),
        vad.get("probability"),
    ):
        if isinstance(probability, int | float) and not isinstance(probability, bool):
            return probability >= SPEECH_PROBABILITY_THRESHOLD
    if encoding == PCM_F32LE and samples is not None:
        threshold = vad.get("silence_rms", silence_rms)
        if not isinstance(threshold, int | float) or isinstance(threshold, bool):
            threshold = silence_rms
        return rms(samples) >= threshold
    return True


__all__ = [
    "DUPLEX_INPUT_RATE_HZ",
    "DuplexInputConverter",
    "InputAudioConverter",
    "OutputAudioEncoder",
    "StreamingResampler",
    "WavHeader",
    "alaw_to_int16",
    "b64decode_audio",
    "b64encode_audio",
    "decode_audio",
    "decode_wav",
    "encode_audio",
    "encode_wav",
    "estimate_decoded_samples",
    "f32le_to_float",
    "float_to_f32le",
    "float_to_int16",
    "float_to_pcm16",
    "int16_to_alaw",
    "int16_to_ulaw",
    "is_wav",
    "parse_wav_header",
    "pcm16_to_float",
    "rms",
    "speech_verdict",
    "ulaw_to_int16",
]
