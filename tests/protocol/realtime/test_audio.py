"""Audio codecs against known sample values, and the streaming resampler."""

import struct

import numpy as np
import pytest

from shared.protocol.duplex import DuplexInputConverter, OutputAudioEncoder, RealtimeProtocolError
from shared.protocol.realtime import audio
from shared.protocol.realtime.formats import AudioFormat, parse_audio_format

# ---------------------------------------------------------------- G.711 (ITU-T G.711 values)


def test_ulaw_decode_table_edges():
    table = audio.ULAW_DECODE
    assert table[0xFF] == 0 and table[0x7F] == 0  # positive and negative zero
    assert table[0x80] == 32124 and table[0x00] == -32124  # the extremes
    assert table[0xFE] == 8 and table[0x7E] == -8  # smallest non-zero steps
    assert table[0xF0] == 120 and table[0xEF] == 132  # segment 0/1 boundary
    assert np.all(np.diff(table[0x80:].astype(int)) < 0)  # monotonic within a sign


def test_alaw_decode_table_edges():
    table = audio.ALAW_DECODE
    assert table[0xD5] == 8 and table[0x55] == -8  # smallest magnitudes
    assert table[0xAA] == 32256 and table[0x2A] == -32256  # the extremes
    assert table[0xD4] == 24 and table[0xC5] == 264  # segment 0 and segment 1 starts


@pytest.mark.parametrize(
    "sample, ulaw, alaw",
    [
        (0, 0xFF, 0xD5),
        (-1, 0x7F, 0x55),
        (8, 0xFE, 0xD5),
        (32767, 0x80, 0xAA),
        (-32768, 0x00, 0x2A),
        (40000 - 65536, 0x00 + 0x0, None),  # -25536 is deep in the last negative segment
    ],
)
def test_g711_encode_known_values(sample, ulaw, alaw):
    encoded = audio.int16_to_ulaw(np.array([sample]))
    if sample == 40000 - 65536:
        assert audio.ULAW_DECODE[encoded[0]] < -24000
        return
    assert encoded == bytes([ulaw])
    assert audio.int16_to_alaw(np.array([sample])) == bytes([alaw])


def test_g711_encode_decode_is_stable_and_bounded():
    every = np.arange(-32768, 32768)
    assert np.abs(audio.ulaw_to_int16(audio.int16_to_ulaw(every)).astype(int) - every).max() <= 644
    assert np.abs(audio.alaw_to_int16(audio.int16_to_alaw(every)).astype(int) - every).max() <= 512
    codes = np.arange(256, dtype=np.uint8)
    # re-encoding a decoded code gives the code back (µ-law's negative zero becomes positive zero)
    assert audio.int16_to_alaw(audio.ALAW_DECODE) == codes.tobytes()
    reencoded = np.frombuffer(audio.int16_to_ulaw(audio.ULAW_DECODE), np.uint8)
    assert (
        np.array_equal(reencoded[codes != 0x7F], codes[codes != 0x7F]) and reencoded[0x7F] == 0xFF
    )


# ---------------------------------------------------------------- linear PCM


def test_pcm16_known_values_and_clipping():
    data = struct.pack("<4h", 0, 16384, -32768, 32767)
    assert audio.pcm16_to_float(data).tolist() == [0.0, 0.5, -1.0, 32767 / 32768]
    assert audio.float_to_pcm16(np.array([0.0, 0.5, -1.0, 2.0, -2.0], np.float32)) == struct.pack(
        "<5h", 0, 16384, -32768, 32767, -32768
    )
    with pytest.raises(RealtimeProtocolError) as info:
        audio.pcm16_to_float(b"\x00")
    assert info.value.code == "bad_audio"


def test_f32le_passes_values_and_neutralises_nan():
    data = struct.pack("<4f", 0.25, -0.5, float("nan"), float("inf"))
    assert audio.f32le_to_float(data).tolist() == [0.25, -0.5, 0.0, 1.0]
    with pytest.raises(RealtimeProtocolError):
        audio.f32le_to_float(b"\x00\x00")


def test_base64_is_strict():
    assert audio.b64decode_audio("AAE=") == b"\x00\x01"
    for bad in ("AAE", "A=AE", "AA E=", "AAE=\n", "ä"):
        with pytest.raises(RealtimeProtocolError) as info:
            audio.b64decode_audio(bad)
        assert info.value.code == "bad_audio"


# ---------------------------------------------------------------- WAV


def wav_bytes(
    samples: np.ndarray,
    rate: int,
    *,
    tag: int = 1,
    bits: int = 16,
    channels: int = 1,
    extensible=False,
):
    data = samples.tobytes()
    block = channels * bits // 8
    fmt_tag = 0xFFFE if extensible else tag
    fmt = struct.pack("<HHIIHH", fmt_tag, channels, rate, rate * block, block, bits)
    if extensible:
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", tag) + bytes(14)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    chunks += b"LIST" + struct.pack("<I", 3) + b"abc\x00"  # odd-sized chunk with a pad byte
    chunks += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


def test_wav_mono_pcm16():
    samples, rate = audio.decode_wav(wav_bytes(np.array([0, 16384, -16384], "<i2"), 22050))
    assert rate == 22050 and samples.tolist() == [0.0, 0.5, -0.5]


def test_wav_stereo_is_averaged():
    frames = np.array([[16384, 0], [-16384, -16384], [32767, -32768]], "<i2")
    samples, _ = audio.decode_wav(wav_bytes(frames, 8000, channels=2))
    assert samples.tolist() == pytest.approx([0.25, -0.5, -0.5 / 32768], abs=1e-6)


def test_wav_float_24bit_8bit_and_extensible():
    floats, _ = audio.decode_wav(wav_bytes(np.array([0.5, -0.25], "<f4"), 16000, tag=3, bits=32))
    assert floats.tolist() == [0.5, -0.25]
    raw24 = np.array([0x400000, -0x400000], np.int32)
    packed = np.frombuffer(raw24.astype("<i4").tobytes(), np.uint8).reshape(-1, 4)[:, :3].copy()
    s24, _ = audio.decode_wav(wav_bytes(packed, 16000, bits=24))
    assert s24.tolist() == [0.5, -0.5]
    s8, _ = audio.decode_wav(wav_bytes(np.array([128, 192, 64], np.uint8), 8000, bits=8))
    assert s8.tolist() == [0.0, 0.5, -0.5]
    ext, rate = audio.decode_wav(wav_bytes(np.array([16384], "<i2"), 48000, extensible=True))
    assert (ext.tolist(), rate) == ([0.5], 48000)


def test_broken_wav_is_bad_audio_and_undecodable_wav_unsupported():
    with pytest.raises(RealtimeProtocolError) as info:
        audio.decode_wav(b"RIFF\x04\x00\x00\x00WAVE")  # no chunks: a broken payload
    assert info.value.code == "bad_audio"
    with pytest.raises(RealtimeProtocolError) as info:  # ADPCM: well formed, not decoded
        audio.decode_wav(wav_bytes(np.zeros(2, "<i2"), 8000, tag=2))
    assert info.value.code == "unsupported_audio_format"


def test_encode_wav_decodes_back():
    samples = np.array([0.0, 0.5, -0.5], np.float32)
    decoded, rate = audio.decode_wav(audio.encode_wav(samples, 24000))
    assert rate == 24000 and decoded.tolist() == samples.tolist()


def test_decode_audio_recognises_wav_whatever_the_declared_format():
    payload = wav_bytes(np.array([16384], "<i2"), 44100)
    samples, rate = audio.decode_audio(payload, AudioFormat("pcm16", 16000))
    assert (samples.tolist(), rate) == ([0.5], 44100)


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize(
    "spelling, expected",
    [
        ("pcm16", ("pcm16", 16000)),
        ("pcm_s16le", ("pcm16", 16000)),
        ("S16LE", ("pcm16", 16000)),
        ("audio/pcm", ("pcm16", 16000)),
        ("f32le", ("pcm_f32le", 16000)),
        ("audio/pcm_f32le", ("pcm_f32le", 16000)),
        ("mulaw", ("g711_ulaw", 8000)),
        ("g711-ulaw", ("g711_ulaw", 8000)),
        ("audio/pcmu", ("g711_ulaw", 8000)),
        ("alaw", ("g711_alaw", 8000)),
        ({"type": "audio/pcm", "rate": 24000}, ("pcm16", 24000)),
        ({"type": "audio/pcma", "sample_rate_hz": 16000}, ("g711_alaw", 16000)),
    ],
)
def test_input_spellings(spelling, expected):
    fmt = parse_audio_format(spelling)
    assert (fmt.encoding, fmt.rate) == expected


def test_output_only_spellings():
    assert parse_audio_format("wav", output=True) == AudioFormat("wav", None)
    assert parse_audio_format("pcm", output=True) == AudioFormat("pcm16", None)
    assert parse_audio_format("audio/wav", output=True).encoding == "wav"
    for spelling in ("wav", "pcm", "mp3", "opus", 16):
        with pytest.raises(RealtimeProtocolError) as info:
            parse_audio_format(spelling)
        assert info.value.code == "unsupported_audio_format"


@pytest.mark.parametrize("rate", [8000, 11025, 44100, 192000, 96000.0])
def test_any_integer_rate_in_range(rate):
    assert parse_audio_format("pcm16", rate=rate).rate == int(rate)


@pytest.mark.parametrize("rate", [7999, 192001, 0, -16000, 22050.5, "16000", True])
def test_rates_out_of_range_are_refused(rate):
    with pytest.raises(RealtimeProtocolError) as info:
        parse_audio_format("pcm16", rate=rate)
    assert info.value.code == "unsupported_audio_format"


# ---------------------------------------------------------------- resampling


def sine(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


@pytest.mark.parametrize(
    "in_rate, out_rate", [(24000, 16000), (8000, 16000), (44100, 16000), (16000, 8000)]
)
def test_resampler_length_and_chunk_boundaries(in_rate, out_rate):
    signal = sine(in_rate, 1.0)
    resampler = audio.StreamingResampler(in_rate, out_rate)
    chunk = in_rate // 50  # 20 ms appends
    pieces = [resampler.process(signal[i : i + chunk]) for i in range(0, len(signal), chunk)]
    pieces.append(resampler.flush())
    chunked = np.concatenate(pieces)
    assert len(chunked) == out_rate  # one second in, one second out, nothing lost at the seams
    one_shot = audio.StreamingResampler(in_rate, out_rate)
    whole = np.concatenate([one_shot.process(signal), one_shot.flush()])
    np.testing.assert_allclose(chunked, whole, atol=1e-6)  # boundaries are inaudible
    expected = sine(out_rate, 1.0)
    middle = slice(out_rate // 10, -out_rate // 10)  # away from the filter's edges
    np.testing.assert_allclose(chunked[middle], expected[middle], atol=0.01)
    assert np.abs(np.diff(chunked[middle])).max() < 0.2  # no clicks


def test_resampler_reset_forgets_history():
    resampler = audio.StreamingResampler(24000, 16000)
    resampler.process(np.ones(2400, np.float32))
    resampler.reset()
    fresh = audio.StreamingResampler(24000, 16000)
    silence = np.zeros(2400, np.float32)
    np.testing.assert_array_equal(resampler.process(silence), fresh.process(silence))


def test_equal_rates_pass_through():
    samples = sine(16000, 0.1)
    assert audio.StreamingResampler(16000, 16000).process(samples) is not None
    np.testing.assert_array_equal(audio.StreamingResampler(16000, 16000).process(samples), samples)


# ---------------------------------------------------------------- converters


def test_input_converter_every_format_to_16k_f32():
    pcm16_24k = audio.float_to_pcm16(sine(24000, 0.5))
    ulaw_8k = audio.int16_to_ulaw(audio.float_to_int16(sine(8000, 0.5)))
    alaw_8k = audio.int16_to_alaw(audio.float_to_int16(sine(8000, 0.5)))
    f32_16k = audio.float_to_f32le(sine(16000, 0.5))
    cases = [
        (pcm16_24k, AudioFormat("pcm16", 24000)),
        (ulaw_8k, AudioFormat("g711_ulaw", 8000)),
        (alaw_8k, AudioFormat("g711_alaw", 8000)),
        (f32_16k, AudioFormat("pcm_f32le", 16000)),
    ]
    for payload, fmt in cases:
        converter = DuplexInputConverter()
        pieces = [converter.convert(payload[i : i + 960], fmt) for i in range(0, len(payload), 960)]
        out = np.concatenate([*pieces, converter.flush()])  # a commit flushes the lookahead
        assert out.dtype == np.float32
        assert len(out) == 8000, fmt  # 0.5 s at 16 kHz, nothing lost
        middle = out[1000:6000]
        np.testing.assert_allclose(middle, sine(16000, 0.5)[1000:6000], atol=0.03)
    passthrough = DuplexInputConverter().convert_to_f32le(f32_16k, AudioFormat("pcm_f32le", 16000))
    assert passthrough == f32_16k  # pcm_f32le at 16 kHz passes through unchanged


def test_input_converter_rebuilds_on_rate_change_and_resets_on_clear():
    converter = DuplexInputConverter()
    converter.convert(audio.float_to_pcm16(sine(24000, 0.1)), AudioFormat("pcm16", 24000))
    converter.reset()
    fresh = DuplexInputConverter()
    payload = audio.float_to_pcm16(sine(24000, 0.1))
    np.testing.assert_array_equal(
        converter.convert(payload, AudioFormat("pcm16", 24000)),
        fresh.convert(payload, AudioFormat("pcm16", 24000)),
    )
    out = converter.convert(audio.float_to_pcm16(sine(48000, 0.1)), AudioFormat("pcm16", 48000))
    assert out.dtype == np.float32


def test_output_encoder_g711_defaults_to_8k_and_flushes():
    encoder = OutputAudioEncoder(AudioFormat("g711_ulaw", 8000), source_rate=24000)
    signal = sine(24000, 1.0)
    body = (
        b"".join(encoder.encode(signal[i : i + 2400]) for i in range(0, 24000, 2400))
        + encoder.flush()
    )
    assert len(body) == 8000  # one byte per 8 kHz sample
    decoded = audio.ulaw_to_int16(body).astype(np.float32) / 32768
    np.testing.assert_allclose(decoded[800:-800], sine(8000, 1.0)[800:-800], atol=0.03)


def test_output_encoder_native_rate_pcm16_and_wav():
    encoder = OutputAudioEncoder(AudioFormat("pcm16", None), source_rate=24000)
    assert encoder.rate == 24000
    assert encoder.encode(np.array([0.5], np.float32)) == struct.pack("<h", 16384)
    wav = OutputAudioEncoder(AudioFormat("wav", None), source_rate=22050).encode(
        np.array([0.5], np.float32)
    )
    assert audio.decode_wav(wav)[1] == 22050
