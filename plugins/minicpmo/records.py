"""A MiniCPM-o unit's state record: what the unit fed the model, so that a slot's memory
after N units is a function of its options and its N records (replayed elsewhere after a
drain or a failover).

A record holds the unit's *inputs*, not the model's memory (which is orders of magnitude
larger: 10 audio embeddings of the 8B model are 80 kB in bf16, a camera frame's 64 are
512 kB), and everything the model decided:

    offset  size          what
    0       1             version (1)
    1       1             fed tokens (<= 20)
    2       1             codec codes (<= 25)
    3       1             camera frames (<= MAX_IMAGES)
    4       32000         the unit's audio: 16000 samples of pcm16 (little-endian), the
                          exact numbers the model heard (its input is quantised to pcm16
                          before it hears it, so a replay hears the same)
    32004   4 * fed       each fed token: its id (bits 0-29) and how it came (bits 30-31:
                          chosen, forced, or a `<|listen|>` replaced by `<|tts_bos|>`)
    ...     2 * codes     the codec codes the speech model gave (uint16)
    ...     per frame     4-byte length + the client's image bytes (JPEG or PNG)

What a replay derives instead of storing: the unit's words and end of turn (from the fed
tokens), the decision history of the repetition penalty (chosen and replaced tokens), the
turn state, the speech model's memory (each speaking unit's condition and codes of the open
turn), the mel and audio-encoder state (from the audio), the camera embeddings (from the
image bytes).

Size: 32,004 bytes + 4 per fed token + 2 per code: 32,008 for a listening unit (it fed
`<|listen|>` alone), at most 32,134 for a speaking one (19 chosen tokens, the forced
`<|chunk_eos|>`, 25 codes); at most 1.93 MB a minute. Camera frames add their bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Sequence

import numpy as np

RECORD_VERSION = 1
UNIT_SAMPLES = 16000
_HEADER = struct.Struct("<BBBB")
_AUDIO_BYTES = UNIT_SAMPLES * 2
_ID_BITS = 30
_ID_MASK = (1 << _ID_BITS) - 1
#: camera frames one unit may carry (what the session's input bounds too)
MAX_IMAGES = 4


class TokenOrigin(enum.IntEnum):
    """How a fed token came to be, as a record keeps it: a replay rebuilds the slot's
    history of decisions from it (only CHOSEN and REPLACED tokens are decisions; a
    REPLACED `<|tts_bos|>` was decided as `<|listen|>`)."""

    CHOSEN = 0
    FORCED = 1
    REPLACED = 2


class RecordError(ValueError):
    """Bytes that are not a unit record of this version."""


@dataclasses.dataclass(frozen=True)
class UnitRecord:
    audio: np.ndarray  # int16 [16000]
    fed: tuple[int, ...]
    origins: tuple[TokenOrigin, ...]
    codes: tuple[int, ...]
    images: tuple[bytes, ...] = ()

    def encode(self) -> bytes:
        if self.audio.dtype != np.int16 or self.audio.shape != (UNIT_SAMPLES,):
            raise RecordError(f"a unit's audio is int16 [{UNIT_SAMPLES}]")
        if len(self.fed) != len(self.origins) or len(self.fed) > 255 or len(self.codes) > 255:
            raise RecordError("a unit feeds at most 255 tokens and gives at most 255 codes")
        if len(self.images) > MAX_IMAGES:
            raise RecordError(f"a unit carries at most {MAX_IMAGES} camera frames")
        parts = [
            _HEADER.pack(RECORD_VERSION, len(self.fed), len(self.codes), len(self.images)),
            self.audio.astype("<i2").tobytes(),
            np.array(
                [
                    token | (int(origin) << _ID_BITS)
                    for token, origin in zip(self.fed, self.origins, strict=True)
                ],
                dtype="<u4",
            ).tobytes(),
            np.array(self.codes, dtype="<u2").tobytes(),
        ]
        for image in self.images:
            parts += [struct.pack("<I", len(image)), image]
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> UnitRecord:
        if len(data) < _HEADER.size + _AUDIO_BYTES:
            raise RecordError(f"a unit record has at least {_HEADER.size + _AUDIO_BYTES} bytes")
        version, n_fed, n_codes, n_images = _HEADER.unpack_from(data)
        if version != RECORD_VERSION:
            raise RecordError(f"unit record version {version}; this worker reads {RECORD_VERSION}")
        at = _HEADER.size
        fixed = at + _AUDIO_BYTES + 4 * n_fed + 2 * n_codes
        if len(data) < fixed:
            raise RecordError(f"a unit record of {len(data)} bytes is cut short")
        audio = np.frombuffer(data, dtype="<i2", count=UNIT_SAMPLES, offset=at).astype(np.int16)
        at += _AUDIO_BYTES
        words = np.frombuffer(data, dtype="<u4", count=n_fed, offset=at)
        at += 4 * n_fed
        codes = np.frombuffer(data, dtype="<u2", count=n_codes, offset=at)
        at += 2 * n_codes
        images = []
        for _ in range(n_images):
            if at + 4 > len(data):
                raise RecordError(f"a unit record of {len(data)} bytes is cut short")
            (length,) = struct.unpack_from("<I", data, at)
            at += 4
            images.append(bytes(data[at : at + length]))
            at += length
        if at != len(data):
            raise RecordError(f"a unit record of {len(data)} bytes holds {at}")
        return cls(
            audio=audio,
            fed=tuple(int(w) & _ID_MASK for w in words),
            origins=tuple(TokenOrigin(int(w) >> _ID_BITS) for w in words),
            codes=tuple(int(c) for c in codes),
            images=tuple(images),
        )


def quantise(samples: np.ndarray) -> np.ndarray:
    """float32 audio in [-1, 1] as the int16 a record keeps (clipped, rounded)."""
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)


def dequantise(samples: np.ndarray) -> np.ndarray:
    return samples.astype(np.float32) / 32768.0


def decisions(
    fed: Sequence[int], origins: Sequence[TokenOrigin], *, listen: int, chunk_eos: int
) -> list[int]:
    """The tokens a unit added to its slot's decision history: chosen ones as fed, and
    `<|listen|>` for each replaced one (the history holds what was decided). A chosen
    `<|chunk_eos|>` never joined it: only the first look can choose it, and that look
    returns before the history is written."""
    out = []
    for token, origin in zip(fed, origins, strict=True):
        if origin == TokenOrigin.CHOSEN and token != chunk_eos:
            out.append(token)
        elif origin == TokenOrigin.REPLACED:
            out.append(listen)
    return out


__all__ = [
    "MAX_IMAGES",
    "RECORD_VERSION",
    "UNIT_SAMPLES",
    "RecordError",
    "TokenOrigin",
    "UnitRecord",
    "decisions",
    "dequantise",
    "quantise",
]
