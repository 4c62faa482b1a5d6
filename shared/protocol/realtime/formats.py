"""Audio format spellings, what is supported, and the declared sample rate.

Clients declare formats in two spellings: the beta flat string
(`"input_audio_format": "pcm16"`) and the GA object
(`"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}`).
Both normalise to one `AudioFormat(encoding, rate)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shared.protocol.realtime.errors import RealtimeProtocolError

PCM16 = "pcm16"
PCM_F32LE = "pcm_f32le"
G711_ULAW = "g711_ulaw"
G711_ALAW = "g711_alaw"
WAV = "wav"

INPUT_ENCODINGS = frozenset({PCM16, PCM_F32LE, G711_ULAW, G711_ALAW})
OUTPUT_ENCODINGS = INPUT_ENCODINGS | {WAV}

MIN_RATE_HZ = 8_000
MAX_RATE_HZ = 192_000
G711_RATE_HZ = 8_000
#: Declared pcm16 / pcm_f32le without a rate means 16 kHz (RealtimeInputDefaults).
DEFAULT_INPUT_RATE_HZ = 16_000

# Every accepted spelling -> canonical encoding. `pcm` is an output-only
# spelling (the reference's internal response_format for the pcm16 family).
_INPUT_SPELLINGS: dict[str, str] = {
    "pcm16": PCM16,
    "pcm_s16le": PCM16,
    "s16le": PCM16,
    "audio/pcm": PCM16,
    "pcm_f32le": PCM_F32LE,
    "f32le": PCM_F32LE,
    "audio/pcm_f32le": PCM_F32LE,
    "g711_ulaw": G711_ULAW,
    "ulaw": G711_ULAW,
    "mulaw": G711_ULAW,
    "g711-ulaw": G711_ULAW,
    "audio/pcmu": G711_ULAW,
    "g711_alaw": G711_ALAW,
    "alaw": G711_ALAW,
    "g711-alaw": G711_ALAW,
    "audio/pcma": G711_ALAW,
}
_OUTPUT_SPELLINGS: dict[str, str] = {**_INPUT_SPELLINGS, "pcm": PCM16, "wav": WAV, "audio/wav": WAV}

# The GA `type` we render for each encoding (OpenAI's three, plus our two).
GA_TYPES: dict[str, str] = {
    PCM16: "audio/pcm",
    G711_ULAW: "audio/pcmu",
    G711_ALAW: "audio/pcma",
    PCM_F32LE: "audio/pcm_f32le",
    WAV: "audio/wav",
}


@dataclasses.dataclass(frozen=True)
class AudioFormat:
    """A canonical encoding and its sample rate.

    `rate` is None only for an output format that follows the model's native
    rate (pcm16/f32/wav output without a declared rate).
    """

    encoding: str
    rate: int | None

    @property
    def is_g711(self) -> bool:
        return self.encoding in (G711_ULAW, G711_ALAW)

    def to_beta(self) -> str:
        return self.encoding

    def to_ga(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": GA_TYPES[self.encoding]}
        if self.rate is not None:
            out["rate"] = self.rate
        return out


def canonical_encoding(spelling: str, *, output: bool = False) -> str | None:
    """The canonical encoding of a spelling, or None when unsupported."""
    table = _OUTPUT_SPELLINGS if output else _INPUT_SPELLINGS
    return table.get(spelling.strip().lower())


def validate_rate(rate: Any, *, param: str = "sample_rate_hz") -> int:
    """A declared rate must be an integer in 8 000-192 000 Hz."""
    if isinstance(rate, float) and rate.is_integer():
        rate = int(rate)
    if (
        not isinstance(rate, int)
        or isinstance(rate, bool)
        or not MIN_RATE_HZ <= rate <= MAX_RATE_HZ
    ):
        raise RealtimeProtocolError(
            "unsupported_audio_format",
            f"sample rate must be an integer in {MIN_RATE_HZ}-{MAX_RATE_HZ} Hz, got {rate!r}",
            param=param,
        )
    return rate


def default_rate(encoding: str, *, output: bool) -> int | None:
    if encoding in (G711_ULAW, G711_ALAW):
        return G711_RATE_HZ
    return None if output else DEFAULT_INPUT_RATE_HZ


def parse_audio_format(
    value: Any,
    *,
    rate: Any = None,
    output: bool = False,
    param: str = "format",
    fallback: AudioFormat | None = None,
) -> AudioFormat:
    """Normalise a declared format (string or GA object) plus an optional rate.

    `rate` is a separately declared rate (`sample_rate_hz`), used when the
    format itself carries none. `fallback` is the format already in force (the
    session's): an undeclared rate of the same encoding keeps its rate.
    """
    if isinstance(value, Mapping):
        declared_rate = value.get("rate", value.get("sample_rate_hz", value.get("sample_rate")))
        if declared_rate is not None:
            rate = declared_rate
        value = value.get("type")
    if not isinstance(value, str):
        raise RealtimeProtocolError(
            "unsupported_audio_format", f"audio format must be a string, got {value!r}", param=param
        )
    encoding = canonical_encoding(value, output=output)
    if encoding is None:
        allowed = sorted(_OUTPUT_SPELLINGS if output else _INPUT_SPELLINGS)
        raise RealtimeProtocolError(
            "unsupported_audio_format",
            f"unsupported {'output' if output else 'input'} audio format {value!r}; "
            f"accepted: {', '.join(allowed)}",
            param=param,
        )
    if rate is not None:
        return AudioFormat(encoding, validate_rate(rate, param=param))
    if fallback is not None and fallback.encoding == encoding:
        return fallback
    return AudioFormat(encoding, default_rate(encoding, output=output))
