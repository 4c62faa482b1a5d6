"""The golden lists still describe what our side can rebuild: the scenarios give the same input
bytes, the builder's tokenizer the same prompt and special ids, and every list is well formed
(README.md says how the lists were made). A failure here is a drift of inputs or of the lists
themselves, not of our model."""

import json
from pathlib import Path

import pytest

from plugins.minicpmo.builder import special_token_ids, tiny_tokenizer
from tests.plugins.minicpmo.golden.scenarios import (
    SCENARIOS,
    audio_digest,
    decode_frame,
    unit_digest,
)

GOLDEN = Path(__file__).resolve().parent
MIN_GAP = 0.05  # make_golden.py refuses lists with a closer call
CODES = 6562  # the tiny TTS's codes; the last is EOS, never returned
UNIT_POSITIONS = 20  # the reference's max_new_speak_tokens_per_chunk
HOP = 160  # the Whisper feature extractor's hop: one mel frame per 10 ms
POOL = 5  # the audio embeddings' average pooling step (audio_pool_step)


def golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_scenario_gives_the_inputs_the_list_was_made_from(name):
    scenario, document = SCENARIOS[name](), golden(name)
    assert document["scenario"] == name
    assert document["builder_seed"] == 0
    assert document["reference"]["commit"] == "c7e1660"
    assert len(document["units"]) == len(scenario.units)
    for unit, recorded in zip(scenario.units, document["units"], strict=True):
        assert unit_digest(unit) == recorded["input_sha256"], f"unit {recorded['index']}"
        assert [list(decode_frame(f).size) for f in unit.frames] == recorded["frames"]
        assert unit.audio.dtype.name == "float32" and unit.audio.shape == (16000,)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_reference_voice_is_the_one_the_list_was_made_from(name):
    scenario, prompt = SCENARIOS[name](), golden(name)["prompt"]
    if scenario.ref_audio is None:
        assert "ref_audio" not in prompt and "positions" not in prompt
        return
    voice, recorded = scenario.ref_audio, prompt["ref_audio"]
    assert voice.dtype.name == "float32" and voice.ndim == 1
    assert (voice * 32768 == (voice * 32768).round()).all()  # exactly pcm16
    assert audio_digest(voice) == recorded["sha256"]
    assert recorded["samples"] == voice.shape[0]


def test_the_reference_voice_scenario_feeds_a_voice_of_whole_and_partial_chunks():
    # a clip that is not whole seconds, so the 1 s chunk mask ends in a partial chunk
    voices = [s.ref_audio for make in SCENARIOS.values() if (s := make()).ref_audio is not None]
    assert voices and all(voice.shape[0] % 16000 != 0 for voice in voices)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_prompt_of_the_list_holds_its_prefix_voice_and_suffix(name):
    prompt = golden(name)["prompt"]
    if "ref_audio" not in prompt:
        return
    voice = prompt["ref_audio"]
    # one mel frame per started hop (the feature extractor's attention mask taken every 160
    # samples), the Whisper CNN's stride 2, then the average pooling
    frames = -(-voice["samples"] // HOP)
    embeddings = ((frames - 1) // 2 + 1 - POOL) // POOL + 1
    assert (voice["mel_frames"], voice["embeddings"]) == (frames, embeddings)
    assert len(voice["mel_frame_means"]) == frames
    assert len(voice["embedding_norms"]) == embeddings
    assert prompt["positions"] == len(prompt["prefix_ids"]) + embeddings + len(prompt["suffix_ids"])
    # the log-mel floor (max - 8 in log10, scaled by 1/4) cuts the voice's quiet frames
    low, high = voice["mel_range"]
    assert low == pytest.approx(high - 2.0, abs=1e-5)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_tokenizer_gives_the_prompt_and_special_ids_of_the_list(name):
    scenario, document = SCENARIOS[name](), golden(name)
    tokenizer = tiny_tokenizer()
    prompt = document["prompt"]
    assert (prompt["prefix"], prompt["suffix"]) == (scenario.prefix, scenario.suffix)
    assert tokenizer.encode(scenario.prefix, add_special_tokens=False).ids == prompt["prefix_ids"]
    assert tokenizer.encode(scenario.suffix, add_special_tokens=False).ids == prompt["suffix_ids"]
    ids = special_token_ids()
    assert document["special_ids"] == {name: ids[name] for name in document["special_ids"]}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_unit_of_the_list_is_well_formed(name):
    ids = special_token_ids()
    for unit in golden(name)["units"]:
        kinds, fed = unit["kinds"], unit["ids"]
        assert len(kinds) == len(fed) <= UNIT_POSITIONS + 1
        assert (kinds[-1], fed[-1]) == ("unit_end", ids["</unit>"])
        generated = kinds[:-1]
        # one decode() call per sampled position; the forced <|chunk_eos|> only at the 20th
        assert len(unit["decisions"]) == sum(k != "forced_chunk_eos" for k in generated)
        for position, (kind, token) in enumerate(zip(generated, fed, strict=False)):
            if kind == "forced_chunk_eos":
                assert (position, token) == (UNIT_POSITIONS - 1, ids["<|chunk_eos|>"])
            if kind == "listen_replaced":
                assert token == ids["<|tts_bos|>"]
        assert unit["listen"] == (fed[-2] == ids["<|listen|>"])
        if unit["listen"]:
            assert unit["codes"] is None and unit["vocoder_calls"] == []
        else:
            assert 0 <= len(unit["codes"]) <= 25
            assert all(0 <= code < CODES - 1 for code in unit["codes"])
            assert len(unit["tts_margins"]) >= len(unit["codes"])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_greedy_call_of_the_list_is_close(name):
    margins = golden(name)["minimum_margins"]
    assert margins["llm_gap"] >= MIN_GAP
    assert margins["llm_chunk_eos_gap"] >= MIN_GAP
    assert margins["tts_gap"] >= MIN_GAP
