"""Audio work is bounded by what it produces: every rate that can reach the resampler is
in 8-192 kHz, WAV headers are checked before any decode, and the decoded size is known
from the header alone (issue 14)."""

import struct

import numpy as np
import orjson
import pytest

from shared.protocol.duplex import (
    DuplexInputConverter,
    RealtimeProtocolError,
    StreamingResampler,
    decode_audio,
    decode_wav,
    estimate_decoded_samples,
    float_to_pcm16,
    parse_client_event,
    parse_wav_header,
)
from shared.protocol.duplex.session import DuplexSessionConfig
from shared.protocol.realtime.formats import AudioFormat


def wav(
    payload: bytes,
    rate: int,
    *,
    channels: int = 1,
    bits: int = 16,
    tag: int = 1,
    fmt_size: int = 16,
    data_size: int | None = None,
    before_data: bytes = b"",
) -> bytes:
    block = channels * bits // 8 & 0xFFFF
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block & 0xFFFFFFFF, block, bits)
    fmt = fmt.ljust(fmt_size, b"\0")[: max(fmt_size, 16)]
    chunks = b"fmt " + struct.pack("<I", fmt_size) + fmt + before_data
    size = len(payload) if data_size is None else data_size
    chunks += b"data" + struct.pack("<I", size) + payload
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


PCM_6KB = bytes(6 * 1024)


def refused(call, *args) -> RealtimeProtocolError:
    with pytest.raises(RealtimeProtocolError) as info:
        call(*args)
    return info.value


# ---------------------------------------------------------------- WAV header


@pytest.mark.parametrize("rate", [1, 7999, 192_001, 0xFFFFFFFF])
def test_wav_rate_outside_8_to_192_khz_is_unsupported(rate):
    payload = wav(PCM_6KB, rate)
    for call in (parse_wav_header, decode_wav):
        error = refused(call, payload)
        assert (error.code, error.param) == ("unsupported_audio_format", "audio")
        assert f"got {rate} Hz" in error.message


def test_the_1_hz_attack_is_refused_by_every_entry_point():
    payload = wav(PCM_6KB, 1)
    for call, args in (
        (decode_audio, (payload, AudioFormat("pcm16", 16000))),  # recognised by its header
        (estimate_decoded_samples, (payload, AudioFormat("pcm16", 16000), 16000)),
        (DuplexInputConverter().convert, (payload, AudioFormat("pcm16", 16000))),
    ):
        assert refused(call, *args).code == "unsupported_audio_format"


@pytest.mark.parametrize(
    "fields",
    [
        {"channels": 0},
        {"channels": 9},
        {"channels": 65535},
        {"bits": 12},
        {"bits": 0},
        {"bits": 64},
        {"tag": 3, "bits": 16},  # float is 32-bit only
        {"tag": 2},  # ADPCM
        {"fmt_size": 8},  # shorter than a fmt chunk
        {"fmt_size": 4096},  # a size lie: past the payload
        {"before_data": b"LIST\x00\x00\x00\x00" * 40},  # chunk walk bounded
    ],
)
def test_header_fields_that_scale_work_are_unsupported(fields):
    error = refused(parse_wav_header, wav(PCM_6KB, 16000, **fields))
    assert (error.code, error.param) == ("unsupported_audio_format", "audio")


def test_extensible_header_without_subformat_is_unsupported():
    error = refused(parse_wav_header, wav(PCM_6KB, 16000, tag=0xFFFE, fmt_size=18))
    assert error.code == "unsupported_audio_format"


def test_broken_payloads_stay_bad_audio():
    for payload in (b"RIFF\x04\x00\x00\x00WAVE", b"RIFF\x10\x00\x00\x00WAVEdata\x02\x00\x00\x00ab"):
        assert refused(parse_wav_header, payload).code == "bad_audio"


@pytest.mark.parametrize(
    "rate, channels, bits, tag", [(8000, 1, 8, 1), (192_000, 8, 16, 1), (44100, 2, 32, 3)]
)
def test_edges_of_the_accepted_ranges_decode(rate, channels, bits, tag):
    payload = bytes(channels * bits // 8 * 10)
    header = parse_wav_header(wav(payload, rate, channels=channels, bits=bits, tag=tag))
    assert (header.rate, header.channels, header.bits, header.frames) == (rate, channels, bits, 10)
    samples, decoded_rate = decode_wav(wav(payload, rate, channels=channels, bits=bits, tag=tag))
    assert (samples.size, decoded_rate) == (10, rate)


def test_data_chunk_larger_than_the_payload_is_truncated_to_whole_frames():
    header = parse_wav_header(wav(bytes(7), 16000, data_size=1_000_000_000))
    assert (header.data_size, header.frames) == (6, 3)
    assert decode_wav(wav(bytes(7), 16000, data_size=1_000_000_000))[0].size == 3


# ---------------------------------------------------------------- declared rates


@pytest.mark.parametrize("rate", [1, 7999, 192_001, 10**9])
def test_a_headerless_rate_out_of_range_never_reaches_the_resampler(rate):
    fmt = AudioFormat("pcm16", rate)  # built in code: skips validate_rate
    for call, args in (
        (decode_audio, (bytes(100), fmt)),
        (estimate_decoded_samples, (bytes(100), fmt, 16000)),
        (StreamingResampler, (rate, 16000)),
        (StreamingResampler, (16000, rate)),
    ):
        assert refused(call, *args).code == "unsupported_audio_format"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"sample_rate": 1}, "sample_rate_hz"),
        ({"sample_rate_hz": 4_000_000_000}, "sample_rate_hz"),
        ({"format": {"type": "audio/pcm", "rate": 1}}, "format"),
        ({"format": "pcm16", "sample_rate_hz": 200_000}, "format"),
    ],
)
def test_declared_append_rates_out_of_range_are_unsupported(fields, param):
    event = {"type": "input_audio_buffer.append", "audio": "AAAA", **fields}
    error = refused(parse_client_event, orjson.dumps(event))
    assert (error.code, error.param) == ("unsupported_audio_format", param)


@pytest.mark.parametrize(
    "session",
    [
        {"input_audio_format": {"type": "audio/pcm", "rate": 1}},
        {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 400_000}}}},
        {"audio": {"output": {"format": {"type": "audio/pcm", "rate": 1}}}},
    ],
)
def test_session_rates_out_of_range_are_unsupported(session):
    with pytest.raises(RealtimeProtocolError) as info:
        DuplexSessionConfig.from_realtime(session)
    assert info.value.code == "unsupported_audio_format"


# ---------------------------------------------------------------- the estimate


@pytest.mark.parametrize(
    "encoding, rate, width",
    [("pcm16", 24000, 2), ("pcm16", 8000, 2), ("pcm_f32le", 16000, 4), ("g711_ulaw", 8000, 1)],
)
def test_estimate_matches_what_the_converter_produces(encoding, rate, width):
    data = bytes(width * rate // 10)  # 100 ms
    fmt = AudioFormat(encoding, rate)
    converter = DuplexInputConverter()
    produced = converter.convert(data, fmt).size + converter.flush().size
    assert produced == 1600
    assert estimate_decoded_samples(data, fmt, 16000) == 1600


def test_estimate_of_a_wav_reads_its_header_not_the_declared_format():
    stereo_44k = wav(float_to_pcm16(np.zeros(2 * 4410, np.float32)), 44100, channels=2)
    fmt = AudioFormat("pcm16", 16000)
    assert estimate_decoded_samples(stereo_44k, fmt, 16000) == 1600
    converter = DuplexInputConverter()
    produced = converter.convert(stereo_44k, fmt).size + converter.flush().size
    assert produced == 1600
    assert estimate_decoded_samples(stereo_44k, fmt, 24000) == 2400


def test_estimate_of_empty_and_unknown_formats():
    assert estimate_decoded_samples(b"", AudioFormat("pcm16", 1), 16000) == 0
    assert refused(estimate_decoded_samples, b"ab", AudioFormat("mp3", 16000), 16000).code == (
        "unsupported_audio_format"
    )


def test_long_base64_decodes_in_pieces_exactly_as_in_one_call():
    import base64 as b64
    import os

    from shared.protocol.realtime.audio import B64_PIECE_CHARS, b64decode_audio

    for size in (B64_PIECE_CHARS * 3 // 4, B64_PIECE_CHARS * 3 // 4 + 1, 3 * 1024 * 1024 + 5):
        raw = os.urandom(size)
        assert b64decode_audio(b64.b64encode(raw).decode()) == raw
    text = b64.b64encode(os.urandom(2 * 1024 * 1024)).decode()
    # padding that ends a piece: the pieces alone would decode, one call refuses it
    padded = text[: B64_PIECE_CHARS - 4] + "AA==" + text[B64_PIECE_CHARS:]
    with pytest.raises(RealtimeProtocolError) as info:
        b64decode_audio(padded)
    assert info.value.code == "bad_audio"
    broken = text[: B64_PIECE_CHARS * 2] + "!!!!" + text[B64_PIECE_CHARS * 2 + 4 :]
    with pytest.raises(RealtimeProtocolError) as info:  # a bad character in a later piece
        b64decode_audio(broken)
    assert info.value.code == "bad_audio"
