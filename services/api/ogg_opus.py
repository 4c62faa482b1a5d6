"""Ogg Opus at the API pod, for Moshi's protocol (services/api/moshi_chat.py): 24 kHz mono,
one 80 ms frame (1920 samples) per Opus packet, Ogg pages both ways.

Built on `sphn` (kyutai's Rust bindings of libopus and an Ogg muxer, the codec Moshi's and
PersonaPlex's own servers and LiveKit's PersonaPlex plugin use): `OpusStreamReader` takes
Ogg pages as they come (the first carries the Opus headers) and returns the float PCM
decoded so far; `OpusStreamWriter` takes one frame of float PCM and returns the Ogg bytes
to send (the first call's include the headers).

The session's audio is pcm16 at 24 kHz on both sides of the pod (the surface's format), so
nothing here resamples. The cost, per session-second, is a few milliseconds of the pod's
CPU (docs/benchmarks.md, `surface_cpu`).
"""

from __future__ import annotations

import numpy as np
import sphn

#: Moshi's rate and frame: Mimi's 12.5 Hz at 24 kHz
SAMPLE_RATE = 24_000
FRAME_SAMPLES = 1920
#: one client message is at most this much Ogg (an 80 ms Opus frame is a few hundred bytes;
#: the bound keeps a client from making the reader buffer megabytes)
MAX_MESSAGE_BYTES = 64 * 1024
#: Ogg fed without a sound: the headers and a few pages at most (a real stream decodes a
#: frame every message)
MAX_UNDECODED_BYTES = 256 * 1024
#: the audio one message may decode to (a client's page holds an 80 ms frame, or a few)
MAX_DECODED_SAMPLES = SAMPLE_RATE


class OggOpusError(ValueError):
    """The client's bytes are not an Ogg Opus stream."""


def _to_pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class OpusDecoder:
    """A client's Ogg Opus stream -> pcm16 bytes at 24 kHz.

    What one client can make it hold or make is bounded: a message is at most
    `MAX_MESSAGE_BYTES`; the bytes fed without decoding any audio (sphn buffers a packet
    continued from page to page until it ends) at most `MAX_UNDECODED_BYTES`; the audio
    one message decodes to at most `MAX_DECODED_SAMPLES` (libopus conceals an empty packet
    with its whole buffer, 5 s: a 28-byte message became 240 KB of pcm16)."""

    def __init__(self) -> None:
        self._reader = sphn.OpusStreamReader(SAMPLE_RATE)
        self._undecoded = 0

    def decode(self, pages: bytes) -> bytes:
        """The audio these bytes complete (b"" for a header page or a partial page)."""
        if len(pages) > MAX_MESSAGE_BYTES:
            size = len(pages)
            raise OggOpusError(f"an audio message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
        try:
            samples = self._reader.append_bytes(pages)
        except ValueError as exc:  # sphn's word for a broken stream (a bad capture pattern)
            raise OggOpusError(f"not an Ogg Opus stream: {exc}") from None
        if not samples.size:
            self._undecoded += len(pages)
            if self._undecoded > MAX_UNDECODED_BYTES:
                raise OggOpusError(
                    f"{self._undecoded} bytes of Ogg without a sound (a packet that never ends)"
                )
            return b""
        self._undecoded = 0
        if samples.size > MAX_DECODED_SAMPLES:
            raise OggOpusError(
                f"a message that decodes to {samples.size / SAMPLE_RATE:.2f} s of audio "
                f"(at most {MAX_DECODED_SAMPLES / SAMPLE_RATE:.0f} s: one frame is 80 ms)"
            )
        return _to_pcm16(samples)


class OpusEncoder:
    """pcm16 bytes at 24 kHz -> the Ogg Opus pages of whole 80 ms frames.

    Audio that does not fill a frame waits for the next: the stream a client receives is
    one continuous stream (a session of Moshi's protocol gets a frame for every frame it
    sends, so nothing is left waiting and nothing is padded into it)."""

    def __init__(self) -> None:
        self._writer = sphn.OpusStreamWriter(SAMPLE_RATE)
        self._pending = np.zeros(0, np.float32)

    def encode(self, pcm16: bytes) -> list[bytes]:
        samples = np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768.0
        pending = np.concatenate((self._pending, samples)) if self._pending.size else samples
        pages = []
        whole = pending.size // FRAME_SAMPLES * FRAME_SAMPLES
        for start in range(0, whole, FRAME_SAMPLES):
            page = self._writer.append_pcm(pending[start : start + FRAME_SAMPLES])
            if page:
                pages.append(page)
        self._pending = pending[whole:].copy()
        return pages

