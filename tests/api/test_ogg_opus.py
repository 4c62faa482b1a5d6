"""The API pod's Ogg Opus (Moshi's protocol): what a client's stream decodes to, what the
model's audio encodes to (whole 80 ms frames, a response's tail padded), and a stream that
is not Ogg Opus refused with a clear error."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import sphn

from services.api.ogg_opus import (
    FRAME_SAMPLES,
    MAX_MESSAGE_BYTES,
    SAMPLE_RATE,
    OggOpusError,
    OpusDecoder,
    OpusEncoder,
)


def tone(frames: int, hz: float = 440.0) -> np.ndarray:
    t = np.arange(frames * FRAME_SAMPLES) / SAMPLE_RATE
    return (0.4 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def pcm16(samples: np.ndarray) -> bytes:
    return (samples * 32767).astype("<i2").tobytes()


def rms(pcm: bytes) -> float:
    return float(np.sqrt(np.mean((np.frombuffer(pcm, "<i2") / 32768.0) ** 2)))


def test_a_clients_stream_decodes_to_pcm16_frame_by_frame():
    writer = sphn.OpusStreamWriter(SAMPLE_RATE)  # what LiveKit's plugin and Moshi's client use
    audio = tone(10)
    decoder = OpusDecoder()
    decoded = [
        decoder.decode(writer.append_pcm(audio[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES]))
        for i in range(10)
    ]
    assert [len(d) for d in decoded] == [FRAME_SAMPLES * 2] * 10
    # lossy, but the same loudness (a 440 Hz tone at 0.4: RMS 0.28)
    assert abs(rms(b"".join(decoded[2:])) - 0.4 / np.sqrt(2)) < 0.05


def test_the_models_audio_encodes_to_whole_frames_and_a_partial_one_waits():
    encoder, reader = OpusEncoder(), sphn.OpusStreamReader(SAMPLE_RATE)
    audio = pcm16(tone(3))
    pages = encoder.encode(audio[: FRAME_SAMPLES * 3])  # a frame and a half
    pages += encoder.encode(audio[FRAME_SAMPLES * 3 :])  # the rest: 3 frames in all
    assert len(pages) == 3
    assert sum(reader.append_bytes(p).size for p in pages) == 3 * FRAME_SAMPLES
    assert encoder.encode(audio[:200]) == []  # under a frame: waits for the rest
    (page,) = encoder.encode(audio[200:FRAME_SAMPLES * 2])  # the rest makes it whole
    assert reader.append_bytes(page).size == FRAME_SAMPLES


def test_bytes_that_are_not_ogg_opus_are_refused():
    decoder = OpusDecoder()
    with pytest.raises(OggOpusError, match="not an Ogg Opus stream"):
        decoder.decode(b"RIFF" + bytes(60))  # a WAV header is not an Ogg page
    with pytest.raises(OggOpusError, match="at most"):
        OpusDecoder().decode(b"OggS" + bytes(MAX_MESSAGE_BYTES))


# ---------------------------------------------------------------- hostile streams


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if r & 0x80000000 else (r << 1) & 0xFFFFFFFF
        table.append(r)
    return table


CRC = _crc_table()


def ogg_page(seq: int, segments: list[int], data: bytes, header_type: int = 0) -> bytes:
    """One Ogg page with a valid CRC (RFC 3533)."""
    head = b"OggS" + bytes([0, header_type]) + struct.pack("<qII", 0, 1, seq) + bytes(4)
    page = head + bytes([len(segments)]) + bytes(segments) + data
    crc = 0
    for byte in page:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ CRC[((crc >> 24) & 0xFF) ^ byte]
    return page[:22] + struct.pack("<I", crc) + page[26:]


def opened_decoder() -> OpusDecoder:
    decoder = OpusDecoder()
    head = b"OpusHead" + bytes([1, 1]) + struct.pack("<HIhB", 312, SAMPLE_RATE, 0, 0)
    tags = b"OpusTags" + struct.pack("<II", 0, 0)
    assert decoder.decode(ogg_page(0, [len(head)], head, header_type=2)) == b""
    assert decoder.decode(ogg_page(1, [len(tags)], tags)) == b""
    return decoder


def test_a_packet_that_never_ends_is_refused_before_it_fills_the_memory():
    decoder = opened_decoder()
    continued = bytes(255 * 255)  # every lacing value 255: the packet goes on to the next page
    with pytest.raises(OggOpusError, match="without a sound"):
        for seq in range(2, 2 + 100):  # 6.5 MB if it were all kept
            decoder.decode(ogg_page(seq, [255] * 255, continued, header_type=1 if seq > 2 else 0))
    assert seq < 10  # refused within MAX_UNDECODED_BYTES


def test_an_empty_packet_does_not_become_seconds_of_audio():
    """libopus conceals a lost (empty) packet with its whole buffer: 5 s from 28 bytes."""
    decoder = opened_decoder()
    with pytest.raises(OggOpusError, match="decodes to"):
        decoder.decode(ogg_page(2, [0], b""))
