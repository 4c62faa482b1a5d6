"""Our per-slot stepping of transformers' decoder stacks computes what transformers
computes: the same hidden states and logits as `Qwen3ForCausalLM` / Llama run over each
slot's whole sequence at once, whatever the rows' lengths, the order slots join in, or who
shares the batch."""

import pytest
import torch
from transformers import LlamaConfig, LlamaModel

from plugins.minicpmo.config import LanguageConfig, SpeechConfig
from plugins.minicpmo.decoder_stack import ContextFull
from plugins.minicpmo.language import LanguageModel
from plugins.minicpmo.speech import SpeechRequest, SpeechTokenModel, _penalise

TOL = 1e-5


def tiny_language(layers: int = 2) -> LanguageModel:
    torch.manual_seed(0)
    config = LanguageConfig(
        hidden_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        vocab_size=300,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_positions=4096,
        tie_word_embeddings=False,
    )
    model = LanguageModel(config).eval()
    # the q/k norms start at ones: make them matter
    for layer in model.llm.model.layers:
        layer.self_attn.q_norm.weight.data.uniform_(0.5, 1.5)
        layer.self_attn.k_norm.weight.data.uniform_(0.5, 1.5)
    return model


def reference_hidden(model: LanguageModel, embeds: torch.Tensor) -> torch.Tensor:
    """transformers' own forward over one whole sequence: final-norm hidden states."""
    with torch.no_grad():
        out = model.llm.model(inputs_embeds=embeds[None], use_cache=False)
    return out.last_hidden_state[0]


def test_rows_of_any_length_match_transformers_whole_sequence():
    model = tiny_language()
    memory = model.new_memory(slots=3, capacity=64)
    sequences = {slot: torch.randn(n, 128) for slot, n in ((0, 17), (1, 9), (2, 23))}
    chunks = {0: [5, 1, 11], 1: [9], 2: [1, 1, 21]}
    outputs: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    fed = {0: 0, 1: 0, 2: 0}
    # rounds: each slot feeds its next chunk, slots joining and leaving rounds
    for round_index in range(3):
        rows = []
        for slot in (2, 0, 1):  # not in slot order
            if round_index < len(chunks[slot]):
                n = chunks[slot][round_index]
                rows.append((slot, sequences[slot][fed[slot] : fed[slot] + n]))
                fed[slot] += n
        for (slot, _), hidden in zip(rows, model.forward(memory, rows), strict=True):
            outputs[slot].append(hidden)
    for slot, sequence in sequences.items():
        ours = torch.cat(outputs[slot])
        theirs = reference_hidden(model, sequence)
        assert memory.length(slot) == sequence.shape[0]
        assert torch.allclose(ours, theirs, atol=TOL), (slot, (ours - theirs).abs().max())
        assert torch.allclose(
            model.logits(ours), model.llm(inputs_embeds=sequence[None]).logits[0], atol=1e-4
        )


def test_a_reset_slot_starts_again_and_its_neighbours_are_untouched():
    model = tiny_language()
    memory = model.new_memory(slots=2, capacity=32)
    a, b = torch.randn(6, 128), torch.randn(6, 128)
    model.forward(memory, [(0, a[:3]), (1, b[:3])])
    memory.reset(0)
    first = model.forward(memory, [(0, a), (1, b[3:])])
    assert torch.allclose(first[0], reference_hidden(model, a), atol=TOL)
    assert torch.allclose(first[1], reference_hidden(model, b)[3:], atol=TOL)


def test_a_slot_past_its_capacity_is_refused_before_anything_is_written():
    model = tiny_language()
    memory = model.new_memory(slots=1, capacity=8)
    model.forward(memory, [(0, torch.randn(6, 128))])
    with pytest.raises(ContextFull):
        model.forward(memory, [(0, torch.randn(3, 128))])
    assert memory.length(0) == 6


def test_speech_backbone_matches_transformers_llama():
    torch.manual_seed(1)
    config = SpeechConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=128,
        max_positions=4096,
        llm_dim=128,
        num_audio_tokens=6562,
        num_text_tokens=300,
        audio_bos_token_id=290,
        num_vq=1,
    )
    speech = SpeechTokenModel(config).eval()
    llama = LlamaModel(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_hidden_layers=2,
            max_position_embeddings=4096,
            vocab_size=8,
        )
    ).eval()
    llama.layers.load_state_dict(speech.model.layers.state_dict())
    llama.norm.load_state_dict(speech.model.norm.state_dict())
    memory = speech.new_memory(slots=2, capacity=64)
    x = torch.randn(12, 64)
    ours = torch.cat(
        [
            speech.stack.forward(memory, [(1, x[:7])])[0],
            speech.stack.forward(memory, [(1, x[7:])])[0],
        ]
    )
    with torch.no_grad():
        theirs = llama(inputs_embeds=x[None]).last_hidden_state[0]
    assert torch.allclose(ours, theirs, atol=TOL)


def test_speech_sampling_keeps_25_codes_and_feeds_only_what_it_returns():
    torch.manual_seed(2)
    config = SpeechConfig(
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=128,
        max_positions=4096,
        llm_dim=128,
        num_audio_tokens=6562,
        num_text_tokens=300,
        audio_bos_token_id=290,
        num_vq=1,
    )
    speech = SpeechTokenModel(config).eval()
    head = speech.head_code[0].parametrizations.weight
    head.original0.data.fill_(1.0)
    head.original1.data.normal_()
    # the end code can never win: a mid-turn unit gives exactly 25 codes
    head.original0.data[config.eos_code] = 0.0
    memory = speech.new_memory(slots=2, capacity=256)
    condition = speech.condition([5, 6], torch.randn(2, 128))
    assert condition.shape == (3, 64)
    codes = speech.generate(
        memory, [SpeechRequest(slot=0, condition=condition, min_new=26, generator=None)]
    )
    assert len(codes[0]) == 25
    assert memory.length(0) == 3 + 25


def test_speech_repetition_penalty_is_count_based_and_sign_aware():
    row = torch.tensor([2.0, -2.0, 1.0, -1.0])
    out = _penalise(row, [0, 0, 1, 3], 2.0)
    assert out.tolist() == [0.5, -4.0, 1.0, -2.0]


def test_dropping_positions_leaves_what_feeding_the_kept_ones_would_have():
    # one layer: its keys and values depend on the inputs and positions alone, so after the
    # drop (kept keys rotated back) they are exactly those of the kept inputs fed at their
    # new places; deeper layers keep what they computed with the dropped context, as the
    # reference's sliding window does
    model = tiny_language(layers=1)
    memory = model.new_memory(slots=2, capacity=64)
    prompt, old, recent, new = (torch.randn(n, 128) for n in (5, 7, 6, 3))
    model.forward(memory, [(0, torch.cat([prompt, old, recent]))])
    model.stack.drop(memory, 0, 5, 12)  # forget `old`
    assert memory.length(0) == 11
    after_drop = model.forward(memory, [(0, new)])[0]
    # as if `old` had never been fed
    reference = model.forward(memory, [(1, torch.cat([prompt, recent, new]))])[0][-3:]
    assert torch.allclose(after_drop, reference, atol=TOL)
