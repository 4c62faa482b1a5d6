"""Ogg Opus at the API pod, for Moshi's protocol (services/api/moshi_chat.py): 24 kHz mono,
Ogg pages both ways, one message of the server's per 80 ms frame.

In: `sphn`'s `OpusStreamReader` (kyutai's Rust bindings of libopus and an Ogg demuxer, the
codec Moshi's and PersonaPlex's own servers and LiveKit's PersonaPlex plugin use) takes Ogg
pages as they come and returns the float PCM decoded so far.

Out: the stream `moshi.server` sends (sphn's `OpusStreamWriter`): an `OpusHead` page, an
`OpusTags` page, then per 80 ms frame two 40 ms Opus packets, each on a page of its own,
the headers in the first frame's message. We write it ourselves (`OggOpusWriter`) around
libopus's encoder (services/api/libopus.py), because sphn's writer costs about 1 ms of the
pod's CPU for a listening model's frame and holds the GIL while it works; where libopus is
not installed the pod falls back to sphn's writer (`new_encoder`, logged once). Encoding
runs on the pod's `EncoderThread`, off its event loop.

The session's audio is pcm16 at 24 kHz on both sides of the pod (the surface's format), so
nothing here resamples. The cost, per session-second, is in docs/benchmarks.md
(`surface_cpu`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import zlib
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import sphn

from services.api import libopus

log = logging.getLogger("duplex.api.ogg_opus")

#: Moshi's rate and frame: Mimi's 12.5 Hz at 24 kHz
SAMPLE_RATE = 24_000
FRAME_SAMPLES = 1920
#: the Opus packet the server sends: 40 ms, two to a frame, as `moshi.server` sends them
PACKET_SAMPLES = 960
#: an Ogg Opus granule position counts 48 kHz samples, whatever the stream's rate
GRANULE_RATE = 48_000
#: the `OpusTags` vendor string
VENDOR = b"duplex-serve"
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


class OggOpusEncoder(ABC):
    """pcm16 bytes at 24 kHz -> the messages of whole 80 ms frames, each the Ogg bytes of
    one frame (the first one's with the stream's headers before it).

    Audio that does not fill a frame waits for the next: the stream a client receives is
    one continuous stream (a session of Moshi's protocol gets a frame for every frame it
    sends, so nothing is left waiting and nothing is padded into it). One thread at a time
    calls `encode`."""

    def __init__(self) -> None:
        self._pending = b""

    def encode(self, pcm16: bytes) -> list[bytes]:
        pending = self._pending + pcm16 if self._pending else pcm16
        step = FRAME_SAMPLES * 2
        whole = len(pending) // step * step
        messages = [self._frame(pending[start : start + step]) for start in range(0, whole, step)]
        self._pending = pending[whole:]
        return [m for m in messages if m]

    @abstractmethod
    def _frame(self, pcm16: bytes) -> bytes:
        """The Ogg bytes of one 80 ms frame."""


class LibopusEncoder(OggOpusEncoder):
    """libopus (AUDIO, complexity 5) in our Ogg writer: the pod's encoder."""

    def __init__(self) -> None:
        super().__init__()
        self._opus = libopus.Encoder(SAMPLE_RATE)
        # the pre-skip counts 48 kHz samples: the encoder's look-ahead at its own rate, scaled
        self._ogg = OggOpusWriter(pre_skip=self._opus.lookahead * GRANULE_RATE // SAMPLE_RATE)

    def _frame(self, pcm16: bytes) -> bytes:
        step = PACKET_SAMPLES * 2
        ticks = PACKET_SAMPLES * GRANULE_RATE // SAMPLE_RATE
        return b"".join(
            self._ogg.page(self._opus.encode(pcm16[start : start + step]), ticks)
            for start in range(0, len(pcm16), step)
        )


class SphnEncoder(OggOpusEncoder):
    """sphn's `OpusStreamWriter`, the one `moshi.server` uses: where libopus is missing."""

    def __init__(self) -> None:
        super().__init__()
        self._writer = sphn.OpusStreamWriter(SAMPLE_RATE)

    def _frame(self, pcm16: bytes) -> bytes:
        samples = np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768.0
        return self._writer.append_pcm(samples)


def new_encoder() -> OggOpusEncoder:
    """libopus's encoder where the library is installed, sphn's otherwise (said once)."""
    try:
        return LibopusEncoder()
    except libopus.LibopusMissing as exc:
        _warn_fallback(str(exc))
        return SphnEncoder()


_fallback_said = False


def _warn_fallback(why: str) -> None:
    global _fallback_said
    if not _fallback_said:
        _fallback_said = True
        log.warning(
            "%s: Moshi-protocol sessions use sphn's Opus encoder, which costs the pod "
            "about 5 times the CPU for a listening model (logged once)",
            why,
        )


# ---------------------------------------------------------------- the Ogg pages


#: each byte's bits reversed: Ogg's CRC is zlib's polynomial, unreflected
_REVERSED = bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))


def ogg_crc(data: bytes) -> int:
    """Ogg's page checksum (CRC-32, polynomial 0x04C11DB7, not reflected, initial value 0,
    no final xor), by zlib's reflected CRC-32 of the bit-reversed bytes: C speed, where
    a table walk in Python costs more than the encoder."""
    reflected = zlib.crc32(data.translate(_REVERSED), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int.from_bytes(reflected.to_bytes(4, "little").translate(_REVERSED), "big")


class OggOpusWriter:
    """One logical Ogg stream of Opus packets, one packet to a page (RFC 7845): the first
    page (`BOS`) the `OpusHead` header, the second `OpusTags`, then the audio; the headers
    go out before the first packet's page. The serial number is random, as RFC 3533 asks
    (sphn's writer uses 42)."""

    BOS = 0x02

    def __init__(self, pre_skip: int) -> None:
        self.serial = int.from_bytes(os.urandom(4), "little")
        self.sequence = 0
        self.granule = 0
        head = b"OpusHead" + struct.pack("<BBHIhB", 1, 1, pre_skip, SAMPLE_RATE, 0, 0)
        tags = b"OpusTags" + struct.pack("<I", len(VENDOR)) + VENDOR + struct.pack("<I", 0)
        self._headers: bytes | None = self._page(head, 0, self.BOS) + self._page(tags, 0, 0)

    def page(self, packet: bytes, ticks: int) -> bytes:
        """The page of one packet of `ticks` 48 kHz samples (the headers before the first)."""
        self.granule += ticks
        page = self._page(packet, self.granule, 0)
        if self._headers is not None:
            page, self._headers = self._headers + page, None
        return page

    def _page(self, packet: bytes, granule: int, flags: int) -> bytes:
        full, rest = divmod(len(packet), 255)
        if full >= 255:
            raise ValueError(f"an Opus packet of {len(packet)} bytes does not fit one page")
        lacing = b"\xff" * full + bytes((rest,))
        header = struct.pack(
            "<4sBBqIIIB", b"OggS", 0, flags, granule, self.serial, self.sequence, 0, len(lacing)
        )
        self.sequence += 1
        page = header + lacing + packet
        return page[:22] + struct.pack("<I", ogg_crc(page)) + page[26:]


# ---------------------------------------------------------------- off the loop


class EncoderThread:
    """The pod's one thread for Opus encoding: each Moshi-protocol session's frames are
    encoded here, in the order its connection awaits them, while the event loop serves
    every socket. libopus releases the GIL while it encodes, so the loop runs beside it;
    one thread is enough for a pod of a core or two (its Python share is a few
    microseconds a frame), and it keeps each encoder to one thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opus-encode")
        self._closed = False

    async def encode(self, encoder: OggOpusEncoder, pcm16: bytes) -> list[bytes]:
        if self._closed:  # the pod is stopping: a socket still sending encodes on the loop
            return encoder.encode(pcm16)
        return await asyncio.get_running_loop().run_in_executor(self._pool, encoder.encode, pcm16)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
