"""PCM / G.711 / WAV decode and encode, and streaming resampling.

Samples inside the codec are mono float32 in [-1, 1). Everything here is pure
and synchronous; callers that sit on an event loop offload it to an executor,
except `parse_wav_header` and `estimate_decoded_samples`, which read a header
and a length only and so size the work before any of it is done.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import struct

import numpy as np
import soxr

from shared.protocol.realtime.errors import RealtimeProtocolError
from shared.protocol.realtime.formats import (
    G711_ALAW,
    G711_RATE_HZ,
    G711_ULAW,
    MAX_RATE_HZ,
    MIN_RATE_HZ,
    PCM16,
    PCM_F32LE,
    WAV,
    AudioFormat,
    validate_rate,
)

_INT16_SCALE = 32768.0


def bad_audio(message: str, param: str = "audio") -> RealtimeProtocolError:
    return RealtimeProtocolError("bad_audio", message, param=param)


# ---------------------------------------------------------------- base64


#: base64 longer than this is decoded in pieces of this many characters (a multiple of 4)
B64_PIECE_CHARS = 512 * 1024


def b64decode_audio(text: str, *, param: str = "audio") -> bytes:
    """Strict base64 (RFC 4648 alphabet, padding required); anything else is `bad_audio`.

    A long payload is decoded in pieces: one C call on 10 MiB of base64 holds the GIL for
    about 35 ms, pieces let another thread (the API pod's event loop, when a large frame
    is parsed on a thread) run between them. The result is the same as one call: pieces
    are cut on 4-character boundaries, and a payload with padding before its last piece
    (which one call would decode differently) is decoded in one call."""
    try:
        if len(text) <= B64_PIECE_CHARS or len(text) % 4 or "=" in text[:-4]:
            return base64.b64decode(text, validate=True)
        return b"".join(
            base64.b64decode(text[start : start + B64_PIECE_CHARS], validate=True)
            for start in range(0, len(text), B64_PIECE_CHARS)
        )
    except (binascii.Error, ValueError) as exc:
        raise bad_audio(f"invalid base64 audio: {exc}", param) from None


def b64encode_audio(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------- linear PCM


def pcm16_to_float(data: bytes) -> np.ndarray:
    if len(data) % 2:
        raise bad_audio("pcm16 audio must be a whole number of 16-bit samples")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(_INT16_SCALE)


def float_to_int16(samples: np.ndarray) -> np.ndarray:
    scaled = np.rint(np.asarray(samples, dtype=np.float32) * _INT16_SCALE)
    return np.clip(scaled, -32768, 32767).astype("<i2")


def float_to_pcm16(samples: np.ndarray) -> bytes:
    return float_to_int16(samples).tobytes()


def f32le_to_float(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise bad_audio("pcm_f32le audio must be a whole number of 32-bit samples")
    samples = np.frombuffer(data, dtype="<f4").astype(np.float32)
    # A NaN would poison every later resampler output of the session.
    return np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0)


def float_to_f32le(samples: np.ndarray) -> bytes:
    return np.asarray(samples, dtype="<f4").tobytes()


# ---------------------------------------------------------------- G.711 (ITU-T G.711 tables)


def _ulaw_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(u & 0x80, -magnitude, magnitude).astype(np.int16)


def _alaw_decode_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    segment = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(segment == 0, t + 8, (t + 0x108) << np.maximum(segment - 1, 0))
    return np.where(a & 0x80, t, -t).astype(np.int16)


def _ulaw_encode_table() -> np.ndarray:
    """int16 (offset by 32768) -> µ-law byte, computed once for all 65 536 inputs."""
    x = np.arange(-32768, 32768, dtype=np.int32)
    sign = np.where(x < 0, 0x80, 0)
    magnitude = np.minimum(np.abs(x), 32635) + 0x84
    exponent = np.floor(np.log2(magnitude >> 7)).astype(np.int32)  # magnitude >> 7 >= 1
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)


def _alaw_encode_table() -> np.ndarray:
    x = np.arange(-32768, 32768, dtype=np.int32) >> 3  # 13-bit
    mask = np.where(x >= 0, 0xD5, 0x55)
    magnitude = np.where(x >= 0, x, -x - 1)
    segment_ends = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])
    segment = np.searchsorted(segment_ends, magnitude)  # first end >= magnitude
    shift = np.where(segment < 2, 1, segment)
    value = (np.minimum(segment, 7) << 4) | ((magnitude >> shift) & 0x0F)
    value = np.where(segment >= 8, 0x7F, value)
    return ((value ^ mask) & 0xFF).astype(np.uint8)


ULAW_DECODE = _ulaw_decode_table()
ALAW_DECODE = _alaw_decode_table()
_ULAW_ENCODE = _ulaw_encode_table()
_ALAW_ENCODE = _alaw_encode_table()


def ulaw_to_int16(data: bytes) -> np.ndarray:
    return ULAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def alaw_to_int16(data: bytes) -> np.ndarray:
    return ALAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def int16_to_ulaw(samples: np.ndarray) -> bytes:
    return _ULAW_ENCODE[np.asarray(samples, dtype=np.int32) + 32768].tobytes()


def int16_to_alaw(samples: np.ndarray) -> bytes:
    return _ALAW_ENCODE[np.asarray(samples, dtype=np.int32) + 32768].tobytes()


# ---------------------------------------------------------------- WAV

#: (format tag, bits per sample) pairs `decode_wav` decodes: PCM 8/16/24/32, float 32, A-law, µ-law.
WAV_ENCODINGS = frozenset({(1, 8), (1, 16), (1, 24), (1, 32), (3, 32), (6, 8), (7, 8)})
WAV_MAX_CHANNELS = 8
#: A `fmt ` chunk is 16, 18 or 40 bytes; anything far larger is a lie about the header.
_WAV_FMT_SIZES = range(16, 65)
#: Chunks looked at before `data`: the walk runs on the event loop (at submit), so it is bounded.
_WAV_MAX_CHUNKS = 32
_WAVE_FORMAT_EXTENSIBLE = 0xFFFE


def unsupported_audio(message: str, param: str = "audio") -> RealtimeProtocolError:
    return RealtimeProtocolError("unsupported_audio_format", message, param=param)


@dataclasses.dataclass(frozen=True)
class WavHeader:
    """What a RIFF/WAVE header says, checked: every field that scales decode or
    resample work is in range, and `data_size` is what the payload really holds
    (a `data` chunk that claims more is truncated), in whole frames."""

    tag: int
    channels: int
    rate: int
    bits: int
    data_offset: int
    data_size: int

    @property
    def frame_bytes(self) -> int:
        return self.channels * self.bits // 8

    @property
    def frames(self) -> int:
        return self.data_size // self.frame_bytes


def is_wav(data: bytes) -> bool:
    return len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE"


def parse_wav_header(data: bytes) -> WavHeader:
    """Parse and check a WAV header without touching the samples (cheap: a bounded chunk walk).

    A payload that is not a WAV file, or lacks a fmt/data chunk, is `bad_audio`;
    a header we will not decode (rate outside 8-192 kHz, 0 or >8 channels, an
    encoding we do not decode, a lying `fmt ` size, too many chunks) is
    `unsupported_audio_format`: a 1 Hz header once made a 6 KB payload resample
    16 000x on the worker's event loop.
    """
    if not is_wav(data):
        raise bad_audio("not a RIFF/WAVE payload")
    pos, fmt = 12, None
    for _ in range(_WAV_MAX_CHUNKS):
        if pos + 8 > len(data):
            break
        chunk_id, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if chunk_id == b"fmt ":
            fmt = _read_fmt(data, pos + 8, size)
        elif chunk_id == b"data":
            if fmt is None:
                break
            return _checked_header(fmt, pos + 8, min(size, len(data) - pos - 8))
        pos += 8 + size + (size & 1)
    else:
        raise unsupported_audio(f"WAV payload has more than {_WAV_MAX_CHUNKS} chunks before data")
    raise bad_audio("WAV payload has no fmt or data chunk")


def _read_fmt(data: bytes, offset: int, size: int) -> tuple[int, int, int, int]:
    """(tag, channels, rate, bits) of a `fmt ` chunk body; the extensible tag is resolved."""
    if size not in _WAV_FMT_SIZES or offset + size > len(data):
        raise unsupported_audio(f"WAV fmt chunk size {size} is invalid")
    tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", data, offset)
    if tag == _WAVE_FORMAT_EXTENSIBLE:  # the real tag is the first 2 bytes of the GUID
        if size < 26:
            raise unsupported_audio(f"WAV extensible fmt chunk of {size} bytes has no subformat")
        tag = struct.unpack_from("<H", data, offset + 24)[0]
    return tag, channels, rate, bits


def _checked_header(fmt: tuple[int, int, int, int], offset: int, available: int) -> WavHeader:
    tag, channels, rate, bits = fmt
    if not 1 <= channels <= WAV_MAX_CHANNELS:
        raise unsupported_audio(f"WAV channels must be 1-{WAV_MAX_CHANNELS}, got {channels}")
    if not MIN_RATE_HZ <= rate <= MAX_RATE_HZ:
        raise unsupported_audio(
            f"WAV sample rate must be {MIN_RATE_HZ}-{MAX_RATE_HZ} Hz, got {rate} Hz"
        )
    if (tag, bits) not in WAV_ENCODINGS:
        raise unsupported_audio(f"unsupported WAV encoding (format tag {tag}, {bits} bits)")
    frame = channels * bits // 8
    return WavHeader(tag, channels, rate, bits, offset, available - available % frame)


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A RIFF/WAVE payload as (mono float32, rate). Multichannel audio is averaged."""
    header = parse_wav_header(data)
    pcm = data[header.data_offset : header.data_offset + header.data_size]
    tag, bits = header.tag, header.bits
    if tag == 1 and bits == 16:
        samples = np.frombuffer(pcm, "<i2").astype(np.float32) / np.float32(_INT16_SCALE)
    elif tag == 1 and bits == 8:
        samples = (np.frombuffer(pcm, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == 1 and bits == 24:
        raw = np.frombuffer(pcm, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
        ints = np.where(ints & 0x800000, ints - (1 << 24), ints)
        samples = ints.astype(np.float32) / np.float32(1 << 23)
    elif tag == 1 and bits == 32:
        samples = (np.frombuffer(pcm, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    elif tag == 3 and bits == 32:
        samples = f32le_to_float(pcm)
    elif tag == 6 and bits == 8:
        samples = alaw_to_int16(pcm).astype(np.float32) / np.float32(_INT16_SCALE)
    else:  # (7, 8): parse_wav_header admits nothing else
        samples = ulaw_to_int16(pcm).astype(np.float32) / np.float32(_INT16_SCALE)
    if header.channels > 1:
        samples = samples.reshape(-1, header.channels).mean(axis=1, dtype=np.float32)
    return samples.astype(np.float32, copy=False), header.rate


def encode_wav(samples: np.ndarray, rate: int) -> bytes:
    """Mono 16-bit PCM WAV."""
    pcm = float_to_pcm16(samples)
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        36 + len(pcm),
        b"WAVE",
        b"fmt ",
        16,
        1,
        1,
        rate,
        rate * 2,
        2,
        16,
        b"data",
        len(pcm),
    )
    return header + pcm


# ---------------------------------------------------------------- any format


def decode_audio(data: bytes, fmt: AudioFormat) -> tuple[np.ndarray, int]:
    """Decode a payload in `fmt` to (mono float32, rate). A RIFF/WAVE payload
    is recognised by its header whatever the declared encoding, and carries its
    own rate."""
    if fmt.encoding == WAV or is_wav(data):
        return decode_wav(data)
    rate = _declared_rate(fmt)
    if fmt.encoding == PCM16:
        return pcm16_to_float(data), rate
    if fmt.encoding == PCM_F32LE:
        return f32le_to_float(data), rate
    if fmt.encoding == G711_ULAW:
        return ulaw_to_int16(data).astype(np.float32) / np.float32(_INT16_SCALE), rate
    if fmt.encoding == G711_ALAW:
        return alaw_to_int16(data).astype(np.float32) / np.float32(_INT16_SCALE), rate
    raise RealtimeProtocolError("unsupported_audio_format", f"cannot decode {fmt.encoding!r}")


#: Bytes per sample of the headerless input encodings.
_SAMPLE_BYTES = {PCM16: 2, PCM_F32LE: 4, G711_ULAW: 1, G711_ALAW: 1}


def _declared_rate(fmt: AudioFormat) -> int:
    """The rate a headerless payload is at; checked here too, since an `AudioFormat`
    built in code skips `validate_rate` and this rate drives the resampler."""
    return validate_rate(fmt.rate if fmt.rate is not None else G711_RATE_HZ, param="sample_rate_hz")


def estimate_decoded_samples(data: bytes, fmt: AudioFormat, target_rate: int) -> int:
    """How many samples `data` becomes once decoded and resampled to `target_rate`,
    from its length and declared rate (or its WAV header) alone: nothing is decoded.

    Raises what `decode_audio` would raise for a bad header or format, so a caller
    can refuse an append before scheduling any work. Exact up to the resampler's
    lookahead (a few ms held back or released across appends).
    """
    if not data:
        return 0
    if fmt.encoding == WAV or is_wav(data):
        header = parse_wav_header(data)
        frames, rate = header.frames, header.rate
    elif fmt.encoding in _SAMPLE_BYTES:
        frames, rate = len(data) // _SAMPLE_BYTES[fmt.encoding], _declared_rate(fmt)
    else:
        raise unsupported_audio(f"cannot decode {fmt.encoding!r}", param="format")
    return math.ceil(frames * target_rate / rate)


def encode_audio(samples: np.ndarray, encoding: str, rate: int) -> bytes:
    """Encode mono float32 samples (already at `rate`) in `encoding`."""
    if encoding == PCM16:
        return float_to_pcm16(samples)
    if encoding == PCM_F32LE:
        return float_to_f32le(samples)
    if encoding == G711_ULAW:
        return int16_to_ulaw(float_to_int16(samples))
    if encoding == G711_ALAW:
        return int16_to_alaw(float_to_int16(samples))
    if encoding == WAV:
        return encode_wav(samples, rate)
    raise RealtimeProtocolError("unsupported_audio_format", f"cannot encode {encoding!r}")


# ---------------------------------------------------------------- resampling


class StreamingResampler:
    """soxr's streaming resampler, mono float32, state kept across chunks.

    Chunked output equals one-shot output, so append boundaries are inaudible.
    Equal rates pass samples through untouched.
    """

    def __init__(self, in_rate: int, out_rate: int, quality: str = "HQ") -> None:
        # The last gate before soxr: an out-of-range rate is refused, never resampled
        # (soxr allocates the whole output at once: 1 Hz -> 16 kHz is 16 000x the input).
        for rate in (in_rate, out_rate):
            if not MIN_RATE_HZ <= rate <= MAX_RATE_HZ:
                raise unsupported_audio(
                    f"sample rate must be {MIN_RATE_HZ}-{MAX_RATE_HZ} Hz, got {rate} Hz"
                )
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = (
            None
            if in_rate == out_rate
            else soxr.ResampleStream(in_rate, out_rate, 1, "float32", quality)
        )

    def process(self, samples: np.ndarray, *, last: bool = False) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples, last=last)

    def flush(self) -> np.ndarray:
        """Drain the filter's lookahead at the end of a stream; the stream resets."""
        if self._stream is None:
            return np.zeros(0, np.float32)
        tail = self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
        self._stream.clear()
        return tail

    def reset(self) -> None:
        if self._stream is not None:
            self._stream.clear()


class InputAudioConverter:
    """Converts one session's appends, in any input format, to mono float32 at `target_rate`.

    One instance per session: the resampler keeps state across appends and is
    rebuilt when the declared rate changes. `reset()` runs on input clear
    (not on VAD endpoints).
    """

    def __init__(self, target_rate: int) -> None:
        self.target_rate = target_rate
        self._resampler: StreamingResampler | None = None

    def convert(self, data: bytes, fmt: AudioFormat) -> np.ndarray:
        return self.resample(*decode_audio(data, fmt))

    def resample(self, samples: np.ndarray, rate: int) -> np.ndarray:
        """Already decoded samples at `rate` -> the target rate (stream state kept)."""
        if self._resampler is None or self._resampler.in_rate != rate:
            self._resampler = StreamingResampler(rate, self.target_rate)
        return self._resampler.process(samples)

    def convert_to_f32le(self, data: bytes, fmt: AudioFormat) -> bytes:
        return float_to_f32le(self.convert(data, fmt))

    def flush(self) -> np.ndarray:
        """The samples the resampler still holds back (its lookahead), at a turn's end.

        soxr buffers up to a few tens of ms (more when upsampling 8 kHz G.711);
        a commit must flush them or the end of the user's speech never reaches
        the model. The next append starts a fresh stream.
        """
        if self._resampler is None:
            return np.zeros(0, np.float32)
        return self._resampler.flush()

    def reset(self) -> None:
        if self._resampler is not None:
            self._resampler.reset()


class OutputAudioEncoder:
    """Encodes a response's audio (mono float32 at the model's rate) in the session's output format.

    G.711 defaults to 8 kHz; other encodings without a declared rate keep the
    model's native rate. `flush()` at the end of a response drains the
    resampler; `reset()` drops its state (cancel).
    """

    def __init__(self, fmt: AudioFormat, source_rate: int) -> None:
        self.format = fmt
        self.rate = fmt.rate if fmt.rate is not None else source_rate
        self._resampler = StreamingResampler(source_rate, self.rate)

    def encode(self, samples: np.ndarray) -> bytes:
        return encode_audio(self._resampler.process(samples), self.format.encoding, self.rate)

    def flush(self) -> bytes:
        tail = self._resampler.flush()
        return encode_audio(tail, self.format.encoding, self.rate) if tail.size else b""

    def reset(self) -> None:
        self._resampler.reset()
