"""A tiny random MiniCPM-o 4.5 checkpoint in the published layout, for tests.

`build_tiny_checkpoint(out_dir, seed)` writes what the released `openbmb/MiniCPM-o-4_5` directory
holds, at toy sizes: `config.json` (the same nesting: a Qwen3 LLM at the top level, `audio_config`
for the Whisper encoder, `vision_config` for SigLIP, `tts_config` for the speech-token model),
`model.safetensors` under the published parameter names, a byte-level tokenizer whose special
tokens are the real ones (same names, same relative order, small ids), and the processor and
generation files. OpenBMB's own code loads it unchanged, which is how the golden token lists of
tests/plugins/minicpmo/golden/ were made; our implementation loads the same bytes.

Only numpy, torch (as the tensor container safetensors writes), safetensors and tokenizers:
nothing here may depend on transformers' version. Weights come from numpy's PCG64
(`default_rng(seed)`), which gives the same bits on every machine and instruction set; every
file is written in a fixed order, so a seed names one checkpoint byte for byte.

The initialisation is "decisive" (DecisiveInit): a random model's greedy choices are often
near-ties, and two correct implementations that differ in the last float bits (batched and
padded against token-by-token) would then pick different tokens. Here every choice is made by a
designed feature with a wide margin (the sound level of a unit's last 100 ms; the token just
fed; the repetition penalty), while every weight stays random and every part of the model still
moves the logits. A run shows listen and speak units, units the model ends and units the
20-token cap ends, listens refused mid-turn, turn ends, and speech-token runs cut by EOS;
golden/README.md lists them and the margins.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

# The released tokenizer's added tokens in the order of their ids (<unk> at 128244, the rest at
# 151643..151747), each with its `special` flag: a special token is dropped by
# decode(skip_special_tokens=True), the others are not. The reference looks every id up by name.
RELEASED_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<unk>", True),
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<image>", True),
    ("</image>", True),
    ("<ref>", True),
    ("</ref>", True),
    ("<box>", True),
    ("</box>", True),
    ("<quad>", True),
    ("</quad>", True),
    ("<point>", True),
    ("</point>", True),
    ("<slice>", True),
    ("</slice>", True),
    ("<image_id>", True),
    ("</image_id>", True),
    ("<unit>", True),
    ("</unit>", True),
    ("<answer>", True),
    ("</answer>", True),
    ("<focus>", True),
    ("</focus>", True),
    ("<line>", True),
    ("</line>", True),
    ("<perception>", True),
    ("</perception>", True),
    ("<source_image>", True),
    ("</source_image>", True),
    ("<image_save_to>", True),
    ("</image_save_to>", True),
    ("<|audio_start|>", True),
    ("<|audio|>", True),
    ("<|audio_end|>", True),
    ("<|spk_bos|>", True),
    ("<|spk|>", True),
    ("<|spk_eos|>", True),
    ("<|tts_bos|>", True),
    ("<|tts_eos|>", True),
    ("<|listen|>", True),
    ("<|speak|>", True),
    ("<|interrupt|>", True),
    ("<|vad_start|>", True),
    ("<|vad_end|>", True),
    ("<|emotion_start|>", True),
    ("<|emotion_end|>", True),
    ("<|speed_start|>", True),
    ("<|speed_end|>", True),
    ("<|pitch_start|>", True),
    ("<|pitch_end|>", True),
    ("<|turn_bos|>", True),
    ("<|turn_eos|>", True),
    ("<|chunk_eos|>", True),
    ("<|chunk_bos|>", True),
    ("<|chunk_tts_bos|>", True),
    ("<|chunk_tts_eos|>", True),
    ("<|tts_pad|>", True),
    *((f"<|timbre_{n}|>", True) for n in range(7, 32)),
)

# The released tokenizer_config.json's `additional_special_tokens`, in its order.
ADDITIONAL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<unk>",
    "<image>",
    "</image>",
    "<ref>",
    "</ref>",
    "<box>",
    "</box>",
    "<quad>",
    "</quad>",
    "<point>",
    "</point>",
    "<slice>",
    "</slice>",
    "<image_id>",
    "</image_id>",
    "<unit>",
    "</unit>",
    "<answer>",
    "</answer>",
    "<focus>",
    "</focus>",
    "<line>",
    "</line>",
    "<perception>",
    "</perception>",
    "<source_image>",
    "</source_image>",
    "<image_save_to>",
    "</image_save_to>",
    "<|audio_start|>",
    "<|audio|>",
    "<|audio_end|>",
    "<|spk_bos|>",
    "<|spk|>",
    "<|spk_eos|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
    "<|listen|>",
    "<|speak|>",
    "<|interrupt|>",
    "<|vad_start|>",
    "<|vad_end|>",
    "<|emotion_start|>",
    "<|emotion_end|>",
    "<|speed_start|>",
    "<|speed_end|>",
    "<|pitch_start|>",
    "<|pitch_end|>",
    "<|chunk_eos|>",
    "<|chunk_bos|>",
    "<|chunk_tts_bos|>",
    "<|chunk_tts_eos|>",
    "<|tts_pad|>",
    *(f"<|timbre_{n}|>" for n in range(7, 32)),
)

# A few merges over the 256 byte tokens, so that the byte-level BPE vocabulary plus the added
# tokens fill the LLM's vocabulary exactly (every id the LLM can emit decodes to something).
MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"),
    ("h", "e"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("Ġ", "a"),
    ("r", "e"),
    ("Ġ", "s"),
    ("e", "n"),
    ("a", "t"),
    ("o", "r"),
    ("Ġ", "w"),
    ("e", "s"),
    ("i", "s"),
    ("Ġ", "o"),
    ("i", "t"),
    ("Ġ", "i"),
    ("a", "l"),
    ("Ġ", "b"),
    ("e", "d"),
    ("Ġ", "c"),
)
BPE_VOCAB_SIZE = 256 + len(MERGES)
VOCAB_SIZE = BPE_VOCAB_SIZE + len(RELEASED_ADDED_TOKENS)

# The released tokenizer's `bad_token_ids` (6965 ids, never sampled) that are byte tokens: the
# byte tokens keep their ids here, so these are the same tokens. A short list suffices to
# exercise the mask.
BAD_TOKEN_IDS: tuple[int, ...] = (7, 8, 94, 95, 96, 97, 198, 201)


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: each of the 256 bytes as a printable character (printable
    ASCII and Latin-1 map to themselves, the rest to U+0100 onwards), in the order that gives the
    GPT-2 / Qwen byte tokens their ids 0..255."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return {b: mapping[b] for b in [*printable, *(b for b in range(256) if b not in printable)]}


def special_token_ids() -> dict[str, int]:
    """Every added token's id in the tiny tokenizer: after the BPE vocabulary, in released order."""
    return {name: BPE_VOCAB_SIZE + i for i, (name, _) in enumerate(RELEASED_ADDED_TOKENS)}


# --- sizes -------------------------------------------------------------------------------------

LLM_HIDDEN = 128  # the resampler uses hidden // 128 heads: a multiple of 128
LLM_HEADS, LLM_KV_HEADS, LLM_HEAD_DIM = 4, 2, 32
LLM_INTERMEDIATE, LLM_LAYERS = 256, 2
WHISPER_D, WHISPER_HEADS, WHISPER_LAYERS = 32, 2, 2
SIGLIP_D, SIGLIP_HEADS, SIGLIP_INTERMEDIATE = 32, 2, 64
SIGLIP_LAYERS = 3  # before the reference drops the last one (drop_vision_last_layer)
TTS_D, TTS_HEADS, TTS_INTERMEDIATE, TTS_LAYERS = 16, 2, 32, 2
NUM_AUDIO_TOKENS = 6562  # 6561 S3 codes + EOS; the vocoder's silence code 4218 stays valid
LLAMA_DEFAULT_VOCAB = 32000  # the TTS backbone's (unused) embed_tokens: LlamaConfig's default


def tiny_config() -> dict:
    """config.json: the released layout and field names, toy sizes."""
    ids = special_token_ids()
    return {
        "architectures": ["MiniCPMO"],
        "auto_map": {
            "AutoConfig": "configuration_minicpmo.MiniCPMOConfig",
            "AutoModel": "modeling_minicpmo.MiniCPMO",
            "AutoModelForCausalLM": "modeling_minicpmo.MiniCPMO",
        },
        "model_type": "minicpmo",
        "torch_dtype": "float32",
        "transformers_version": "4.51.0",
        # the LLM (MiniCPMOConfig is a Qwen3Config)
        "vocab_size": VOCAB_SIZE,
        "hidden_size": LLM_HIDDEN,
        "intermediate_size": LLM_INTERMEDIATE,
        "num_hidden_layers": LLM_LAYERS,
        "num_attention_heads": LLM_HEADS,
        "num_key_value_heads": LLM_KV_HEADS,
        "head_dim": LLM_HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": LLM_LAYERS,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        # the multimodal model
        "query_num": 64,
        "image_size": 448,
        "patch_size": 14,
        "drop_vision_last_layer": True,
        "batch_vision_input": True,
        "use_image_id": True,
        "vision_batch_size": 16,
        "audio_pool_step": 5,
        "audio_chunk_length": 1.0,
        "stream_input": True,
        "listen_speak_type": "asr",
        "init_vision": True,
        "init_audio": True,
        "init_tts": True,
        "slice_config": {
            "model_type": "minicpmv",
            "patch_size": 14,
            "max_slice_nums": 9,
            "scale_resolution": 448,
        },
        "vision_config": {
            "model_type": "siglip",
            "hidden_size": SIGLIP_D,
            "intermediate_size": SIGLIP_INTERMEDIATE,
            "num_hidden_layers": SIGLIP_LAYERS,
            "num_attention_heads": SIGLIP_HEADS,
            "num_channels": 3,
            "image_size": 980,
            "patch_size": 14,
            "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-06,
            "attention_dropout": 0.0,
        },
        "audio_config": {
            "model_type": "whisper",
            "num_mel_bins": 80,
            "d_model": WHISPER_D,
            "encoder_layers": WHISPER_LAYERS,
            "encoder_attention_heads": WHISPER_HEADS,
            "encoder_ffn_dim": 4 * WHISPER_D,  # the projector reads encoder_ffn_dim // 4 features
            "decoder_layers": WHISPER_LAYERS,
            "decoder_attention_heads": WHISPER_HEADS,
            "decoder_ffn_dim": 4 * WHISPER_D,
            "max_source_positions": 1500,  # the streaming KV is dropped when it would pass this
            "max_target_positions": 448,
            "activation_function": "gelu",
            "scale_embedding": False,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
            "encoder_layerdrop": 0.0,
            "decoder_layerdrop": 0.0,
        },
        "tts_config": {
            "model_type": "minicpmtts",
            "llm_dim": LLM_HIDDEN,
            "hidden_size": TTS_D,
            "intermediate_size": TTS_INTERMEDIATE,
            "num_attention_heads": TTS_HEADS,
            "num_key_value_heads": TTS_HEADS,
            "num_hidden_layers": TTS_LAYERS,
            "max_position_embeddings": 4096,
            "num_audio_tokens": NUM_AUDIO_TOKENS,
            "num_text_tokens": VOCAB_SIZE,
            "num_vq": 1,
            "num_mel_bins": 100,
            "audio_bos_token_id": ids["<focus>"],  # the released 151687 is <focus>'s id
            "text_eos_token_id": ids["</focus>"],
            "backbone_model": "llama",
            "projector_type": "mlp",
            "hidden_act": "silu",
            "condition_type": "hidden_text_merge",
            "normalize_projected_hidden": True,
            "audio_tokenizer_type": "s3tokenizer_step_audio",
            "audio_tokenizer_sample_rate": 16000,
            "streaming": True,
            "attn_implementation": "sdpa",
            "use_llm_hidden_state": False,
            "use_text": True,
        },
    }


# --- parameters --------------------------------------------------------------------------------


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter of the reference MiniCPMO for `config`, by its published name, in a fixed
    order (the order the weights are drawn in)."""
    shapes: dict[str, tuple[int, ...]] = {}
    d, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inter = config["intermediate_size"]
    shapes["llm.model.embed_tokens.weight"] = (vocab, d)
    for i in range(config["num_hidden_layers"]):
        p = f"llm.model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (heads * hd, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv * hd, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv * hd, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, heads * hd)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, d)
        shapes[p + "mlp.up_proj.weight"] = (inter, d)
        shapes[p + "mlp.down_proj.weight"] = (d, inter)
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
    shapes["llm.model.norm.weight"] = (d,)
    shapes["llm.lm_head.weight"] = (vocab, d)

    vc = config["vision_config"]
    vd, vi, patch = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]
    shapes["vpm.embeddings.patch_embedding.weight"] = (vd, vc["num_channels"], patch, patch)
    shapes["vpm.embeddings.patch_embedding.bias"] = (vd,)
    shapes["vpm.embeddings.position_embedding.weight"] = ((vc["image_size"] // patch) ** 2, vd)
    kept = vc["num_hidden_layers"] - (1 if config["drop_vision_last_layer"] else 0)
    for i in range(kept):
        p = f"vpm.encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = (vd, vd)
            shapes[p + f"self_attn.{proj}.bias"] = (vd,)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[p + f"{norm}.weight"] = (vd,)
            shapes[p + f"{norm}.bias"] = (vd,)
        shapes[p + "mlp.fc1.weight"] = (vi, vd)
        shapes[p + "mlp.fc1.bias"] = (vi,)
        shapes[p + "mlp.fc2.weight"] = (vd, vi)
        shapes[p + "mlp.fc2.bias"] = (vd,)
    shapes["vpm.post_layernorm.weight"] = (vd,)
    shapes["vpm.post_layernorm.bias"] = (vd,)

    shapes["resampler.query"] = (config["query_num"], d)
    shapes["resampler.kv_proj.weight"] = (d, vd)
    shapes["resampler.attn.in_proj_weight"] = (3 * d, d)
    shapes["resampler.attn.in_proj_bias"] = (3 * d,)
    shapes["resampler.attn.out_proj.weight"] = (d, d)
    shapes["resampler.attn.out_proj.bias"] = (d,)
    for norm in ("ln_q", "ln_kv", "ln_post"):
        shapes[f"resampler.{norm}.weight"] = (d,)
        shapes[f"resampler.{norm}.bias"] = (d,)
    shapes["resampler.proj"] = (d, d)

    ac = config["audio_config"]
    ad, affn, mels = ac["d_model"], ac["encoder_ffn_dim"], ac["num_mel_bins"]
    shapes["apm.conv1.weight"] = (ad, mels, 3)
    shapes["apm.conv1.bias"] = (ad,)
    shapes["apm.conv2.weight"] = (ad, ad, 3)
    shapes["apm.conv2.bias"] = (ad,)
    shapes["apm.embed_positions.weight"] = (ac["max_source_positions"], ad)
    for i in range(ac["encoder_layers"]):
        p = f"apm.layers.{i}."
        shapes[p + "self_attn.k_proj.weight"] = (ad, ad)  # Whisper's key projection has no bias
        for proj in ("v_proj", "q_proj", "out_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = (ad, ad)
            shapes[p + f"self_attn.{proj}.bias"] = (ad,)
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            shapes[p + f"{norm}.weight"] = (ad,)
            shapes[p + f"{norm}.bias"] = (ad,)
        shapes[p + "fc1.weight"] = (affn, ad)
        shapes[p + "fc1.bias"] = (affn,)
        shapes[p + "fc2.weight"] = (ad, affn)
        shapes[p + "fc2.bias"] = (ad,)
    shapes["apm.layer_norm.weight"] = (ad,)
    shapes["apm.layer_norm.bias"] = (ad,)
    shapes["audio_projection_layer.linear1.weight"] = (d, affn // 4)
    shapes["audio_projection_layer.linear1.bias"] = (d,)
    shapes["audio_projection_layer.linear2.weight"] = (d, d)
    shapes["audio_projection_layer.linear2.bias"] = (d,)

    tc = config["tts_config"]
    td, ti = tc["hidden_size"], tc["intermediate_size"]
    codes = tc["num_audio_tokens"]
    shapes["tts.emb_text.weight"] = (tc["num_text_tokens"], td)
    shapes["tts.model.embed_tokens.weight"] = (LLAMA_DEFAULT_VOCAB, td)
    for i in range(tc["num_hidden_layers"]):
        p = f"tts.model.layers.{i}."
        thd = td // tc["num_attention_heads"]
        shapes[p + "self_attn.q_proj.weight"] = (tc["num_attention_heads"] * thd, td)
        shapes[p + "self_attn.k_proj.weight"] = (tc["num_key_value_heads"] * thd, td)
        shapes[p + "self_attn.v_proj.weight"] = (tc["num_key_value_heads"] * thd, td)
        shapes[p + "self_attn.o_proj.weight"] = (td, tc["num_attention_heads"] * thd)
        shapes[p + "mlp.gate_proj.weight"] = (ti, td)
        shapes[p + "mlp.up_proj.weight"] = (ti, td)
        shapes[p + "mlp.down_proj.weight"] = (td, ti)
        shapes[p + "input_layernorm.weight"] = (td,)
        shapes[p + "post_attention_layernorm.weight"] = (td,)
    shapes["tts.model.norm.weight"] = (td,)
    for projector in ("projector_spk", "projector_semantic"):
        shapes[f"tts.{projector}.linear1.weight"] = (td, tc["llm_dim"])
        shapes[f"tts.{projector}.linear1.bias"] = (td,)
        shapes[f"tts.{projector}.linear2.weight"] = (td, td)
        shapes[f"tts.{projector}.linear2.bias"] = (td,)
    for q in range(tc["num_vq"]):
        shapes[f"tts.emb_code.{q}.weight"] = (codes, td)
        # weight_norm(dim=0): original0 is the per-row gain g, original1 the direction v
        shapes[f"tts.head_code.{q}.parametrizations.weight.original0"] = (codes, 1)
        shapes[f"tts.head_code.{q}.parametrizations.weight.original1"] = (codes, td)
    return shapes


# --- initialisation ----------------------------------------------------------------------------

# Plain parameters: LayerNorm/RMSNorm gains near 1 and biases near 0 (random, so that a forgotten
# affine shows), linear maps scaled by 1/sqrt(fan_in) so activations stay near unit size.
NORM_GAIN_STD = 0.1
BIAS_STD = 0.1

# Every draw and every operation below is elementwise IEEE arithmetic (no BLAS, no libm
# transcendental): the same seed gives the same bits on any CPU.


@dataclass(frozen=True)
class DecisiveInit:
    """The structure laid over the plain random weights so that greedy choices are never close.

    The LLM's residual stream is split in four: dimension 0 holds the constant `bias_level` at
    every input, so an output row's weight on it is that token's bias; dimension 1 holds the
    sound level at an audio position (Whisper's channel 0 averages the log-mel over all bins,
    the projector routes it there alone, the pooling makes it the level of 100 ms); dimensions
    2..63 carry the rest of the audio, image and prompt embeddings and what the layers write;
    64..127 carry only the identity of the candidate token fed at that position (a signed
    Hadamard row each, so exactly orthogonal). The layers write outside 2..63 only weakly
    (`leak`). So after a unit's audio the level decides: quiet -> <|listen|>, voice ->
    <|speak|> (the biases put the threshold between the scenarios' quiet and voiced unit ends);
    after a candidate token its successor in `llm_grammar` wins by about `llm_chain_logit`. Two
    tokens that are forbidden to the decoder (a bad_token_id and <|tts_pad|>) sit just above
    <|listen|> and <|speak|>, so the masks are exercised at every unit.

    The speech-token model is split the same way (bias 0, context 1..7, content 8..15): after a
    code the next one in a cycle of `tts_codes` wins, and one code of the cycle is followed by
    EOS wherever EOS is allowed; the first code of a unit is read from the condition (the
    unit's text and LLM states) through attention.
    """

    bias_level: float = 4.0
    leak: float = 0.1  # how much the layers and projectors write outside the context part
    # the level: Whisper channel 0 = level_gain * mean log-mel + level_offset (kept positive,
    # where GELU is monotone), routed to LLM dimension 1 by level_projection
    level_gain: float = 2.0
    level_offset: float = 3.0
    level_projection: float = 4.0
    llm_layer_gain: float = 0.5  # scales the LLM layers' output maps (the context's share)
    llm_context_dims: int = 64  # dimensions 2..63: context; 64..127: content
    llm_chain_logit: float = 20.0  # a grammar successor's designed logit
    llm_spread: float = 0.3  # std of a candidate's logit driven by the context part
    llm_other_bias: float = -30.0  # non-candidate tokens
    # (token, bias, level weight): the tokens the model may output. Byte-level names: "Ġ" is
    # a space. The biases put the level thresholds between the scenarios' sounds.
    llm_candidates: tuple[tuple[str, float, float], ...] = (
        ("<|listen|>", 10.1, -3.0),
        ("(", 11.1, -3.0),  # a bad_token_id over <|listen|>: the mask must hold it back
        ("<|speak|>", 1.0, 0.0),
        ("<|tts_pad|>", 2.0, 0.0),  # forbidden too, over <|speak|>
        ("<|chunk_eos|>", -6.0, 0.0),
        ("<|tts_bos|>", -6.0, 0.0),
        ("<|turn_eos|>", -6.0, 0.0),
        ("<|chunk_tts_eos|>", -6.0, 0.0),
        ("Ġt", -6.0, 0.0),
        ("he", -6.0, 0.0),
        ("re", -6.0, 0.0),
        ("Ġa", -6.0, 0.0),
        ("n", -6.0, 0.0),
        ("d", -6.0, 0.0),
        ("Ġs", -6.0, 0.0),
        ("o", -6.0, 0.0),
        ("on", -6.0, 0.0),
    )
    # (token, successor, strength): after <|speak|> the model says " there" and ends the unit
    # itself; after <|tts_bos|> (a listen refused mid-turn) " and", the end of the turn and
    # <|chunk_tts_eos|>. " the" goes on with "re" only while "re" is fresh: once said, the
    # repetition penalty (logit / 1.05) drops it under " s", whose " so on" loop only the
    # 20-token cap ends; once " s" is stale too, "re" is back on top.
    llm_grammar: tuple[tuple[str, str, float], ...] = (
        ("<|speak|>", "Ġt", 1.0),
        ("Ġt", "he", 1.0),
        ("he", "re", 1.0),
        ("he", "Ġs", 0.975),
        ("re", "<|chunk_eos|>", 1.0),
        ("<|tts_bos|>", "Ġa", 1.0),
        ("Ġa", "n", 1.0),
        ("n", "d", 1.0),
        ("d", "<|turn_eos|>", 1.0),
        ("<|turn_eos|>", "<|chunk_tts_eos|>", 1.0),
        ("Ġs", "o", 1.0),
        ("o", "on", 1.0),
        ("on", "Ġs", 1.0),
    )
    # (token, twin): the token takes its twin's bias and context row, so that where the two
    # compete (" s" against "re" after " the") only their designed strengths differ
    llm_twins: tuple[tuple[str, str], ...] = (("Ġs", "re"),)
    tts_bias_level: float = 1.0  # small: the condition's own parts must not drown in it
    tts_layer_gain: float = 1.0
    tts_context_dims: int = 8  # dimensions 1..7: context; 8..15: content
    tts_text_scale: float = 0.1  # text embeddings vs the unit-norm projected LLM state
    tts_codes: int = 16  # codes in the cycle: +/- the 8 Hadamard rows of the content part
    tts_chain_logit: float = 20.0
    tts_spread: float = 6.0
    tts_code_bias: float = 0.0
    tts_eos_bias: float = -1.0
    tts_eos_after: int = 5  # the cycle's 6th code is followed by EOS where EOS is allowed
    tts_eos_lead: float = 0.6  # ... by this much (as a share of tts_chain_logit)
    tts_other_bias: float = -30.0


DECISIVE_INIT = DecisiveInit()


def hadamard(n: int) -> np.ndarray:
    """Sylvester's n x n Hadamard matrix (n a power of 2): rows of +/-1, pairwise orthogonal."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return rng.standard_normal(shape) * std


NORM_GAINS = (
    "norm.weight",
    "norm1.weight",
    "norm2.weight",
    "ln_q.weight",
    "ln_kv.weight",
    "ln_post.weight",
    "layernorm.weight",
)
EMBEDDINGS = ("embed_tokens.weight", "emb_text.weight", "emb_code.0.weight", "resampler.query")


def _base_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A parameter's plain random value (before the decisive structure is laid over it)."""
    if name.endswith(NORM_GAINS) or name.endswith("parametrizations.weight.original0"):
        return 1.0 + _normal(rng, shape, NORM_GAIN_STD)
    if name.endswith("bias"):
        # Whisper's biases stay small: its output should follow the sound rather than be a
        # constant that every unit shares
        return _normal(rng, shape, BIAS_STD / 5 if name.startswith("apm.") else BIAS_STD)
    if name.endswith(EMBEDDINGS):
        return _normal(rng, shape, 1.0)
    if name.endswith("embed_positions.weight"):
        return _normal(rng, shape, 0.1)
    if name.endswith("position_embedding.weight"):
        return _normal(rng, shape, 0.5)
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    return _normal(rng, shape, 1.0 / np.sqrt(fan_in))


def _token_id(name: str) -> int:
    ids = special_token_ids()
    if name in ids:
        return ids[name]
    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    return vocab[name]


def _quiet_writes(w: dict[str, np.ndarray], writers: list[str], keep: slice, leak: float) -> None:
    """Scale what the output maps `writers` (weights and biases) write into a residual stream
    by `leak` outside the dimensions `keep`."""
    for name in writers:
        mask = np.full(w[name].shape[0], leak)
        mask[keep] = 1.0
        w[name] *= mask.reshape(-1, *([1] * (w[name].ndim - 1)))


def _decisive_audio(w: dict[str, np.ndarray], config: dict, init: DecisiveInit) -> None:
    """Whisper's channel 0 as the sound level, and the projector as a linear map that sends it
    alone to LLM dimension 1."""
    ac = config["audio_config"]
    conv1, conv2 = w["apm.conv1.weight"], w["apm.conv2.weight"]
    conv1[0] = init.level_gain / (ac["num_mel_bins"] * conv1.shape[2])
    w["apm.conv1.bias"][0] = init.level_offset
    conv2[0] = 0.0
    conv2[0, 0] = 1.0 / conv2.shape[2]
    w["apm.conv2.bias"][0] = 0.0
    w["apm.embed_positions.weight"][:, 0] = 0.0
    _quiet_writes(
        w,
        [
            f"apm.layers.{i}.{m}.{p}"
            for i in range(ac["encoder_layers"])
            for m in ("self_attn.out_proj", "fc2")
            for p in ("weight", "bias")
        ],
        slice(1, None),
        init.leak,
    )
    # ReLU(z) - ReLU(-z) = z: half of linear1's rows negate the other half and linear2's columns
    # likewise, so the projector is linear (ReLU's positive mean would otherwise give every
    # audio embedding one shared direction)
    w1, b1 = w["audio_projection_layer.linear1.weight"], w["audio_projection_layer.linear1.bias"]
    w2, b2 = w["audio_projection_layer.linear2.weight"], w["audio_projection_layer.linear2.bias"]
    half = w1.shape[0] // 2
    w1[0, :] = 0.0
    w1[0, 0] = 1.0
    b1[0] = 0.0
    w1[half:], b1[half:] = -w1[:half], -b1[:half]
    w2[1, :] = 0.0
    w2[1, 0] = init.level_projection
    b2[1] = 0.0
    w2[:, half:] = -w2[:, :half]
    # then the bias constant in dimension 0; little in the content part
    ctx = init.llm_context_dims
    w2[0], b2[0] = 0.0, init.bias_level
    w2[ctx:] *= init.leak
    b2[ctx:] *= init.leak


def _decisive_llm(
    w: dict[str, np.ndarray], config: dict, rng: np.random.Generator, init: DecisiveInit
) -> None:
    d, ctx = config["hidden_size"], init.llm_context_dims
    b, leak = init.bias_level, init.leak
    embed = w["llm.model.embed_tokens.weight"]
    embed[:, 0] = b
    embed[:, 1] *= leak
    embed[:, ctx:] *= leak
    # the resampler's output is ln_post(x) @ proj: ln_post's dimension 0 is the constant 1,
    # routed alone to output dimension 0; little level, little content
    proj = w["resampler.proj"]
    w["resampler.ln_post.weight"][0] = 0.0
    w["resampler.ln_post.bias"][0] = 1.0
    proj[0] = 0.0
    proj[:, 0] = 0.0
    proj[0, 0] = b
    proj[:, 1] *= leak
    proj[:, ctx:] *= leak
    writers = [
        f"llm.model.layers.{i}.{m}"
        for i in range(config["num_hidden_layers"])
        for m in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    ]
    for name in writers:
        w[name] *= init.llm_layer_gain
    _quiet_writes(w, writers, slice(2, ctx), leak)

    # candidate tokens: a signed Hadamard row each in the content part
    content = d - ctx
    rows = hadamard(content)[1:]
    candidates = [_token_id(name) for name, _, _ in init.llm_candidates]
    signs = rng.choice([-1.0, 1.0], size=len(candidates))
    direction = {token: signs[k] * rows[k] / np.sqrt(content) for k, token in enumerate(candidates)}
    content_norm = np.sqrt(d - 1.0)  # a candidate's content part as big as a plain embedding
    for token in candidates:
        embed[token, 1:ctx] *= leak
        embed[token, ctx:] = content_norm * direction[token]

    # the output rows, in logit units: after the final RMSNorm a candidate's content part has
    # about content_norm / rms(x) and dimension 0 about b / rms(x), rms(x) ~ sqrt(2) here
    rms = np.sqrt((b * b + 2 * (d - 1.0)) / d)
    head = w["llm.lm_head.weight"]
    head[:, 0] = init.llm_other_bias * rms / b
    head[:, 1:] *= 0.05
    predecessors: dict[int, list[tuple[int, float]]] = {}
    for source, target, strength in init.llm_grammar:
        predecessors.setdefault(_token_id(target), []).append((_token_id(source), strength))
    context_norm = np.sqrt(ctx - 2.0)
    for (_, bias, level), token in zip(init.llm_candidates, candidates, strict=True):
        head[token, 0] = bias * rms / b
        head[token, 1] = level
        head[token, 2:ctx] = _normal(rng, (ctx - 2,), init.llm_spread * rms / context_norm)
        head[token, ctx:] = 0.0
    for token, twin in init.llm_twins:
        head[_token_id(token), :ctx] = head[_token_id(twin), :ctx]
    for token in candidates:
        for source, strength in predecessors.get(token, []):
            head[token, ctx:] += (
                direction[source] * strength * init.llm_chain_logit * rms / content_norm
            )


def _decisive_tts(
    w: dict[str, np.ndarray], config: dict, rng: np.random.Generator, init: DecisiveInit
) -> None:
    tc = config["tts_config"]
    td, codes, ctx = tc["hidden_size"], tc["num_audio_tokens"], init.tts_context_dims
    b, leak = init.tts_bias_level, init.leak
    # text embeddings no bigger than the unit-norm projected LLM state added to them, so that
    # the condition (and through attention the first code) follows what the LLM computed
    text = w["tts.emb_text.weight"]
    text[:, 1:] *= init.tts_text_scale
    text[:, 0] = b
    text[:, ctx:] *= leak
    # audio_bos, the condition's last position, carries the bias alone: the first code is read
    # from the rest of the condition, through attention
    text[tc["audio_bos_token_id"], 1:] = 0.0
    emb_code = w["tts.emb_code.0.weight"]
    emb_code[:, 0] = b
    emb_code[:, ctx:] *= leak
    writers = [
        f"tts.model.layers.{i}.{m}"
        for i in range(tc["num_hidden_layers"])
        for m in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
    ]
    for name in writers:
        w[name] *= init.tts_layer_gain
    _quiet_writes(w, writers, slice(1, ctx), leak)

    # the cycle: code k is followed by code k+1; each code's content is +/- a Hadamard row
    content = td - ctx
    eos = codes - 1
    cycle = [int(c) for c in rng.choice(eos, size=init.tts_codes, replace=False)]
    rows = np.concatenate([hadamard(content), -hadamard(content)])[: init.tts_codes]
    content_norm = np.sqrt(td - 1.0)
    direction = {code: rows[k] / np.sqrt(content) for k, code in enumerate(cycle)}
    for code in cycle:
        emb_code[code, 1:ctx] *= leak
        emb_code[code, ctx:] = content_norm * direction[code]

    rms = np.sqrt((b * b + 2 * (td - 1.0)) / td)
    weight = np.zeros((codes, td))
    weight[:, 0] = init.tts_other_bias * rms / b
    weight[:, 1:] = _normal(rng, (codes, td - 1), 0.05)
    context_norm = np.sqrt(ctx - 1.0)
    chain = init.tts_chain_logit * rms / content_norm
    for k, code in enumerate([*cycle, eos]):
        bias = init.tts_eos_bias if code == eos else init.tts_code_bias
        weight[code, 0] = bias * rms / b
        weight[code, 1:ctx] = _normal(rng, (ctx - 1,), init.tts_spread * rms / context_norm)
        weight[code, ctx:] = 0.0 if code == eos else direction[cycle[k - 1]] * chain
    weight[eos, ctx:] = direction[cycle[init.tts_eos_after]] * chain * (1 + init.tts_eos_lead)
    # weight_norm keeps weight = g * v / |v| (per row): store v as a random positive multiple
    # of the row and g as the row's norm
    g = np.array([[np.sqrt(math.fsum(row * row))] for row in weight])
    w["tts.head_code.0.parametrizations.weight.original0"] = g
    w["tts.head_code.0.parametrizations.weight.original1"] = weight * rng.uniform(
        0.5, 2.0, size=(codes, 1)
    )


def tiny_weights(
    config: dict, seed: int, init: DecisiveInit = DECISIVE_INIT
) -> dict[str, np.ndarray]:
    """Every parameter as float32, drawn from PCG64(seed) in `parameter_shapes` order."""
    rng = np.random.default_rng(seed)
    weights = {
        name: _base_value(name, shape, rng) for name, shape in parameter_shapes(config).items()
    }
    _decisive_audio(weights, config, init)
    _decisive_llm(weights, config, rng, init)
    _decisive_tts(weights, config, rng, init)
    return {name: value.astype(np.float32) for name, value in weights.items()}


# --- tokenizer ---------------------------------------------------------------------------------

# Qwen2's pre-tokenizer split (words, numbers one digit at a time, punctuation runs, newlines)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE over the 256 byte tokens and MERGES, then the released added tokens."""
    from tokenizers import Regex

    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=list(MERGES), fuse_unk=False, byte_fallback=False)
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    for name, special in RELEASED_ADDED_TOKENS:
        token = AddedToken(
            name, lstrip=False, rstrip=False, single_word=False, normalized=False, special=special
        )
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


def _added_token_entry(name: str, special: bool) -> dict:
    return {
        "content": name,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": special,
    }


def tokenizer_config() -> dict:
    ids = special_token_ids()
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[name]): _added_token_entry(name, special)
            for name, special in RELEASED_ADDED_TOKENS
        },
        "additional_special_tokens": list(ADDITIONAL_SPECIAL_TOKENS),
        "bos_token": "<|im_start|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "extra_special_tokens": {},
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "MiniCPMOTokenizerFast",
        "unk_token": "<unk>",
        "auto_map": {"AutoTokenizer": ["tokenization_minicpmo_fast.MiniCPMOTokenizerFast", None]},
        "bad_token_ids": list(BAD_TOKEN_IDS),
    }


def special_tokens_map() -> dict:
    def entry(name: str) -> dict:
        return {k: v for k, v in _added_token_entry(name, True).items() if k != "special"}

    return {
        "additional_special_tokens": [entry(name) for name in ADDITIONAL_SPECIAL_TOKENS],
        "bos_token": "<|im_start|>",
        "eos_token": entry("<|im_end|>"),
        "pad_token": entry("<|endoftext|>"),
        "unk_token": "<unk>",
    }


def preprocessor_config() -> dict:
    """The released preprocessor_config.json (the processor reads it; the Whisper feature
    extractor's own fields keep their defaults: 80 mels, n_fft 400, hop 160, 16 kHz)."""
    return {
        "image_processor_type": "MiniCPMVImageProcessor",
        "feature_extractor_type": "MiniCPMAAudioProcessor",
        "auto_map": {
            "AutoProcessor": "processing_minicpmo.MiniCPMOProcessor",
            "AutoImageProcessor": "processing_minicpmo.MiniCPMVImageProcessor",
            "AutoFeatureExtractor": "processing_minicpmo.MiniCPMAAudioProcessor",
        },
        "processor_class": "MiniCPMOProcessor",
        "max_slice_nums": 9,
        "scale_resolution": 448,
        "patch_size": 14,
        "use_image_id": True,
        "image_feature_size": 64,
        "im_start": "<image>",
        "im_end": "</image>",
        "slice_start": "<slice>",
        "slice_end": "</slice>",
        "unk": "<unk>",
        "im_id_start": "<image_id>",
        "im_id_end": "</image_id>",
        "slice_mode": True,
        "audio_pool_step": 5,
        "norm_mean": [0.5, 0.5, 0.5],
        "norm_std": [0.5, 0.5, 0.5],
        "version": 4.5,
    }


def generation_config() -> dict:
    ids = special_token_ids()
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


# --- writing -----------------------------------------------------------------------------------


def _json_files(tokenizer: Tokenizer) -> Iterator[tuple[str, str]]:
    """Every text file of the checkpoint, as (name, content), in a fixed order."""

    def dumps(value: dict) -> str:
        return json.dumps(value, indent=2, ensure_ascii=False) + "\n"

    yield "config.json", dumps(tiny_config())
    yield "generation_config.json", dumps(generation_config())
    yield "preprocessor_config.json", dumps(preprocessor_config())
    yield "special_tokens_map.json", dumps(special_tokens_map())
    yield "tokenizer_config.json", dumps(tokenizer_config())
    yield "added_tokens.json", dumps(special_token_ids())
    # the Rust side writes its vocabulary from a hash map: re-serialise in id order
    raw = json.loads(tokenizer.to_str())
    raw["model"]["vocab"] = dict(sorted(raw["model"]["vocab"].items(), key=lambda kv: kv[1]))
    yield "tokenizer.json", dumps(raw)
    yield "vocab.json", dumps(raw["model"]["vocab"])
    merges = raw["model"]["merges"]
    yield (
        "merges.txt",
        "#version: 0.2\n"
        + "".join(f"{' '.join(m) if isinstance(m, list) else m}\n" for m in merges),
    )


def build_tiny_checkpoint(
    out_dir: str | Path, seed: int = 0, init: DecisiveInit = DECISIVE_INIT
) -> Path:
    """Write the tiny checkpoint into `out_dir` (created if needed) and return it. The same
    seed gives the same bytes in every file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    tensors = {
        name: torch.from_numpy(value) for name, value in tiny_weights(config, seed, init).items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name, content in _json_files(tiny_tokenizer()):
        (out / name).write_text(content, encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m plugins.minicpmo.builder",
        description="Write a tiny random MiniCPM-o 4.5 checkpoint in the published layout.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_checkpoint(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
