"""The API pod's Ogg Opus (Moshi's protocol): what a client's stream decodes to, what the
model's audio encodes to (whole 80 ms frames, a partial one waiting; the stream
`moshi.server` sends, page by page, from libopus or from sphn where libopus is missing),
encoding off the event loop, and a stream that is not Ogg Opus refused with a clear
error."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest
import sphn

from services.api import libopus, ogg_opus
from services.api.ogg_opus import (
    FRAME_SAMPLES,
    MAX_MESSAGE_BYTES,
    SAMPLE_RATE,
    EncoderThread,
    LibopusEncoder,
    OggOpusError,
    OggOpusWriter,
    OpusDecoder,
    SphnEncoder,
    new_encoder,
)


def _has_libopus() -> bool:
    try:
        libopus.load()
    except libopus.LibopusMissing:
        return False
    return True


#: `make test` installs libopus (Debian's libopus0) where it runs as root
needs_libopus = pytest.mark.skipif(
    not _has_libopus(), reason="libopus is not installed (apt-get install libopus0)"
)
ENCODERS = [pytest.param(LibopusEncoder, marks=needs_libopus), SphnEncoder]


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


@pytest.mark.parametrize("encoder_class", ENCODERS)
def test_the_models_audio_encodes_to_whole_frames_and_a_partial_one_waits(encoder_class):
    encoder, reader = encoder_class(), sphn.OpusStreamReader(SAMPLE_RATE)
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


# ---------------------------------------------------------------- the stream we send


def parse_pages(data: bytes) -> list[dict]:
    """Every Ogg page in `data`, its fields, its packet, and whether its CRC (checked by the
    table walk above, independent of the writer's zlib route) holds."""
    pages, at = [], 0
    while at < len(data):
        assert data[at : at + 4] == b"OggS", f"no page at {at}"
        version, flags, granule, serial, seq, crc, count = struct.unpack_from(
            "<BBqIIIB", data, at + 4
        )
        lacing = data[at + 27 : at + 27 + count]
        size = sum(lacing)
        end = at + 27 + count + size
        page = data[at:end]
        check = 0
        for byte in page[:22] + bytes(4) + page[26:]:
            check = ((check << 8) & 0xFFFFFFFF) ^ CRC[((check >> 24) & 0xFF) ^ byte]
        pages.append(
            dict(flags=flags, granule=granule, serial=serial, seq=seq, crc_ok=check == crc,
                 packet=page[27 + count :], version=version)
        )
        at = end
    return pages


@needs_libopus
def test_libopus_writes_the_stream_moshi_server_sends_two_40_ms_packets_a_frame():
    encoder = LibopusEncoder()
    first, second = encoder.encode(pcm16(tone(2)))
    head, tags, *audio = parse_pages(first)
    assert head["flags"] == OggOpusWriter.BOS and head["packet"][:8] == b"OpusHead"
    version, channels, pre_skip, rate = struct.unpack_from("<BBHI", head["packet"], 8)
    assert (version, channels, rate) == (1, 1, SAMPLE_RATE)
    # the encoder's own look-ahead, in 48 kHz samples (a decoder skips exactly that)
    assert pre_skip == encoder._opus.lookahead * 2 and 0 < pre_skip < 48_000 // 10
    assert tags["packet"][:8] == b"OpusTags" and b"duplex-serve" in tags["packet"]
    audio += parse_pages(second)
    assert len(audio) == 4  # two frames, two 40 ms packets each, a page each
    pages = [head, tags, *audio]
    assert all(p["crc_ok"] and p["version"] == 0 for p in pages)
    assert [p["seq"] for p in pages] == list(range(6))
    assert len({p["serial"] for p in pages}) == 1
    assert [p["granule"] for p in audio] == [1920, 3840, 5760, 7680]  # 40 ms at 48 kHz each
    # each packet is 40 ms: TOC code 0-3 with a 20 ms config means two frames (RFC 6716)
    for page in audio:
        assert libopus_packet_ms(page["packet"]) == 40


def libopus_packet_ms(packet: bytes) -> float:
    toc = packet[0]
    config, code = toc >> 3, toc & 0x3
    if config < 12:
        frame_ms = (10, 20, 40, 60)[config & 0x3]  # SILK
    elif config < 16:
        frame_ms = (10, 20)[config & 0x1]  # hybrid
    else:
        frame_ms = (2.5, 5, 10, 20)[config & 0x3]  # CELT
    frames = 1 if code == 0 else 2 if code in (1, 2) else packet[1] & 0x3F
    return frame_ms * frames


@pytest.mark.parametrize("encoder_class", ENCODERS)
def test_the_stream_decodes_to_what_the_model_said_in_a_clients_reader(encoder_class):
    """sphn's reader is what LiveKit's PersonaPlex plugin and moshi's own client decode
    with: the tone comes back at its loudness, its pitch, sample for sample in length."""
    encoder, reader = encoder_class(), sphn.OpusStreamReader(SAMPLE_RATE)
    messages = encoder.encode(pcm16(tone(25)))
    assert len(messages) == 25
    decoded = np.concatenate([reader.append_bytes(m) for m in messages])
    assert decoded.size == 25 * FRAME_SAMPLES
    body = decoded[FRAME_SAMPLES:]
    assert abs(float(np.sqrt(np.mean(body**2))) - 0.4 / np.sqrt(2)) < 0.03
    spectrum = np.abs(np.fft.rfft(body))
    assert abs(np.argmax(spectrum) * SAMPLE_RATE / body.size - 440) < 5


@needs_libopus
def test_a_quiet_model_still_gets_a_message_per_frame():
    encoder = LibopusEncoder()
    messages = encoder.encode(bytes(FRAME_SAMPLES * 2 * 3))  # a listening model: zeros
    assert len(messages) == 3
    reader = sphn.OpusStreamReader(SAMPLE_RATE)
    decoded = np.concatenate([reader.append_bytes(m) for m in messages])
    assert decoded.size == 3 * FRAME_SAMPLES and not np.any(np.abs(decoded) > 1e-3)


@needs_libopus
def test_each_stream_has_a_serial_of_its_own():
    serials = {parse_pages(LibopusEncoder().encode(bytes(FRAME_SAMPLES * 2))[0])[0]["serial"]
               for _ in range(4)}
    assert len(serials) > 1  # random (RFC 3533): two sessions' streams are told apart


def test_a_packet_too_long_for_one_page_is_refused():
    writer = OggOpusWriter(pre_skip=312)
    assert parse_pages(writer.page(bytes(254 * 255), 960))[-1]["crc_ok"]
    with pytest.raises(ValueError, match="does not fit"):
        writer.page(bytes(255 * 255), 960)


def test_crc_by_zlib_matches_the_table_walk():
    for data in (b"", b"OggS", bytes(range(256)) * 3, sphn_page()):
        check = 0
        for byte in data:
            check = ((check << 8) & 0xFFFFFFFF) ^ CRC[((check >> 24) & 0xFF) ^ byte]
        assert ogg_opus.ogg_crc(data) == check


def sphn_page() -> bytes:
    data = sphn.OpusStreamWriter(SAMPLE_RATE).append_pcm(tone(1))
    return data[: data.index(b"OggS", 4)]


def test_without_libopus_the_pod_falls_back_to_sphn_and_says_so_once(monkeypatch, caplog):
    def missing():
        raise libopus.LibopusMissing("libopus is not installed (Debian: apt-get install libopus0)")

    monkeypatch.setattr(libopus, "load", missing)
    monkeypatch.setattr(ogg_opus, "_fallback_said", False)
    with caplog.at_level("WARNING", logger="duplex.api.ogg_opus"):
        encoders = [new_encoder(), new_encoder()]
    assert all(isinstance(e, SphnEncoder) for e in encoders)
    said = [r for r in caplog.records if "sphn's Opus encoder" in r.getMessage()]
    assert len(said) == 1 and "apt-get install libopus0" in said[0].getMessage()


@needs_libopus
def test_with_libopus_the_pod_uses_it():
    assert isinstance(new_encoder(), LibopusEncoder)
    assert libopus.version().startswith("libopus ")


@needs_libopus
def test_a_libopus_refusal_is_an_error_not_a_crash():
    encoder = libopus.Encoder(SAMPLE_RATE)
    with pytest.raises(libopus.LibopusError, match="opus_encode of 7 samples"):
        encoder.encode(bytes(14))  # not an Opus frame size
    with pytest.raises(libopus.LibopusError, match="opus_encoder_init"):
        libopus.Encoder(44_100)  # not an Opus rate


@needs_libopus
async def test_sessions_encoded_on_the_thread_keep_their_own_order():
    """Many sessions' frames at once, as a batched tick delivers them: each session's
    stream is whole and in its order, and the loop is not the thread that encodes."""
    import threading

    thread = EncoderThread()
    loop_thread = threading.get_ident()
    seen_threads = set()

    class Watched(LibopusEncoder):
        def encode(self, pcm: bytes) -> list[bytes]:
            seen_threads.add(threading.get_ident())
            return super().encode(pcm)

    frames = [pcm16(tone(1, hz=200 + 40 * k)) for k in range(8)]

    async def session(k: int) -> np.ndarray:
        encoder, reader = Watched(), sphn.OpusStreamReader(SAMPLE_RATE)
        out = []
        for _ in range(6):
            for message in await thread.encode(encoder, frames[k]):
                out.append(reader.append_bytes(message))
        return np.concatenate(out)

    try:
        decoded = await asyncio.gather(*(session(k) for k in range(8)))
    finally:
        thread.close()
    assert seen_threads and loop_thread not in seen_threads
    for k, audio in enumerate(decoded):
        assert audio.size == 6 * FRAME_SAMPLES
        body = audio[FRAME_SAMPLES:]
        pitch = np.argmax(np.abs(np.fft.rfft(body))) * SAMPLE_RATE / body.size
        assert abs(pitch - (200 + 40 * k)) < 8
    # once closed (the pod stopping), a socket still sending encodes on the loop
    assert len(await thread.encode(LibopusEncoder(), frames[0])) == 1
