"""A unit's record round-trips exactly and refuses what is not one; the vocoder's streaming
contract (25 codes a second, 3 codes of lookahead, the causal delay) as the duplex loop
drives it."""

import numpy as np
import pytest

from plugins.minicpmo.records import (
    RecordError,
    TokenOrigin,
    UnitRecord,
    decisions,
    dequantise,
    quantise,
)
from plugins.minicpmo.vocoder import (
    OUTPUT_RATE,
    SAMPLES_PER_CODE,
    SILENCE_CODE,
    VOCODER_DELAY_SAMPLES,
    SpeechStream,
    ToneDecoder,
)

LISTEN, CHUNK_EOS, TTS_BOS = 7, 9, 11


def record(fed=(LISTEN,), origins=(TokenOrigin.CHOSEN,), codes=(), images=()):
    audio = np.random.default_rng(0).integers(-32768, 32767, 16000).astype(np.int16)
    return UnitRecord(audio=audio, fed=fed, origins=origins, codes=codes, images=images)


def test_a_listening_unit_is_32008_bytes_and_a_full_speaking_one_32134():
    assert len(record().encode()) == 32008
    full = record(
        fed=(*range(100, 119), CHUNK_EOS),
        origins=(TokenOrigin.CHOSEN,) * 19 + (TokenOrigin.FORCED,),
        codes=tuple(range(25)),
    )
    assert len(full.encode()) == 32134


def test_records_round_trip_with_large_ids_origins_codes_and_images():
    original = record(
        fed=(151705, 151703, 151718),
        origins=(TokenOrigin.FORCED, TokenOrigin.REPLACED, TokenOrigin.CHOSEN),
        codes=(0, 4218, 6560),
        images=(b"\xff\xd8jpeg", b"\x89PNG..."),
    )
    decoded = UnitRecord.decode(original.encode())
    assert decoded.fed == original.fed and decoded.origins == original.origins
    assert decoded.codes == original.codes and decoded.images == original.images
    assert np.array_equal(decoded.audio, original.audio)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b"\x02" + b[1:],  # another version
        lambda b: b[:-1],  # truncated
        lambda b: b + b"\x00",  # trailing bytes
        lambda b: b[:100],  # not even the audio
    ],
)
def test_bytes_that_are_not_a_record_are_refused(mutate):
    with pytest.raises(RecordError):
        UnitRecord.decode(mutate(record(codes=(1, 2)).encode()))


def test_audio_quantisation_is_exact_for_pcm16_input():
    ints = np.arange(-32768, 32768, 7, dtype=np.int16)
    assert np.array_equal(quantise(dequantise(ints)), ints)
    assert quantise(np.array([2.0, -2.0], np.float32)).tolist() == [32767, -32768]


def test_decision_history_holds_chosen_tokens_and_listen_for_replaced_ones():
    fed = (5, TTS_BOS, 6, CHUNK_EOS, LISTEN)
    origins = (
        TokenOrigin.CHOSEN,
        TokenOrigin.REPLACED,
        TokenOrigin.CHOSEN,
        TokenOrigin.CHOSEN,  # a first-look chunk_eos: never in the history
        TokenOrigin.FORCED,
    )
    assert decisions(fed, origins, listen=LISTEN, chunk_eos=CHUNK_EOS) == [5, LISTEN, 6]


def test_a_turn_streams_one_second_per_unit_and_flushes_the_rest_at_its_end():
    stream = SpeechStream(ToneDecoder())
    units = [list(range(1, 26)), list(range(26, 51)), list(range(51, 61))]
    first = stream.push(units[0], first_unit=True, end_of_turn=False)
    # the turn's 3 silence codes and 22 of its codes, after the vocoder's 3840-sample delay
    assert first.size == OUTPUT_RATE
    assert not first[:3840].any()
    second = stream.push(units[1], first_unit=False, end_of_turn=False)
    assert second.size == OUTPUT_RATE
    last = stream.push(units[2], first_unit=False, end_of_turn=True)
    total = first.size + second.size + last.size
    # every code rendered once (the 3 silence codes too), after the delay's silence
    assert total == VOCODER_DELAY_SAMPLES + (3 + 60) * SAMPLES_PER_CODE
    # a new turn starts a new stream: silence codes again, then the delay
    again = stream.push(list(range(1, 26)), first_unit=True, end_of_turn=False)
    assert np.array_equal(again, first)


def test_a_short_chunk_mid_turn_is_padded_to_a_second_and_silence_codes_are_silent():
    stream = SpeechStream(ToneDecoder())
    audio = stream.push([SILENCE_CODE] * 10, first_unit=True, end_of_turn=False)
    assert audio.size == OUTPUT_RATE and not audio.any()
    assert stream.push([], first_unit=False, end_of_turn=False).size == 0


def test_the_tone_decoder_refuses_a_non_final_chunk_without_lookahead():
    decoder = ToneDecoder()
    with pytest.raises(ValueError, match="lookahead"):
        decoder.render(decoder.new_stream(), [1, 2, 3], last=False)


def test_the_real_vocoder_refuses_clearly_where_it_cannot_run(tmp_path, monkeypatch):
    """Token2wav needs its package, a CUDA GPU, the checkpoint's assets and a voice prompt:
    without one the worker's start says which (here: no package, then no GPU)."""
    import sys
    import types

    from plugins.minicpmo.vocoder import Token2wavDecoder, VocoderUnavailable

    voice = tmp_path / "voice.wav"
    voice.write_bytes(b"RIFF")
    monkeypatch.setitem(sys.modules, "stepaudio2", None)
    with pytest.raises(VocoderUnavailable, match="minicpmo-utils"):
        Token2wavDecoder(tmp_path, voice)
    monkeypatch.setitem(sys.modules, "stepaudio2", types.SimpleNamespace(Token2wav=object))
    with pytest.raises(VocoderUnavailable, match="CUDA GPU only"):
        Token2wavDecoder(tmp_path, voice)
