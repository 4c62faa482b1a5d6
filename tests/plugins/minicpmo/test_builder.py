"""The tiny MiniCPM-o 4.5 checkpoint (plugins/minicpmo/builder.py): the published layout, the
sizes the reference's constructors need, the real special tokens at small ids, and the same
bytes for the same seed. Every test builds into its own tmp_path."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from plugins.minicpmo.builder import build_tiny_checkpoint

REPO = Path(__file__).resolve().parents[3]
FILES = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "added_tokens.json",
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "model.safetensors",
)

# The released tokenizer's special tokens that the duplex loop looks up by name, in the order
# of their released ids (151644 <|im_start|> ... 151722 <|tts_pad|>).
DUPLEX_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<image>",
    "</image>",
    "<slice>",
    "</slice>",
    "<unit>",
    "</unit>",
    "<focus>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
    "<|listen|>",
    "<|speak|>",
    "<|turn_eos|>",
    "<|chunk_eos|>",
    "<|chunk_tts_eos|>",
    "<|tts_pad|>",
)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return build_tiny_checkpoint(tmp_path / "tiny", seed=0)


def digests(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in FILES}


def test_the_same_seed_gives_the_same_bytes_in_another_process(checkpoint, tmp_path):
    # the command line, in a fresh interpreter: no state of this process leaks into the bytes
    out = tmp_path / "again"
    subprocess.run(
        [sys.executable, "-m", "plugins.minicpmo.builder", str(out), "--seed", "0"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    assert digests(out) == digests(checkpoint)


def test_another_seed_gives_other_weights_and_the_same_text_files(checkpoint, tmp_path):
    other = digests(build_tiny_checkpoint(tmp_path / "seed1", seed=1))
    mine = digests(checkpoint)
    assert other["model.safetensors"] != mine["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in mine.items() if k != "model.safetensors"
    }


def test_the_config_keeps_the_sizes_the_reference_constructors_need(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "minicpmo"
    assert config["architectures"] == ["MiniCPMO"]
    assert config["auto_map"]["AutoConfig"] == "configuration_minicpmo.MiniCPMOConfig"
    assert config["auto_map"]["AutoModel"] == "modeling_minicpmo.MiniCPMO"
    # the resampler has hidden // 128 heads and a 2-D sincos table over hidden / 4
    assert config["hidden_size"] % 128 == 0
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0
    audio = config["audio_config"]
    # the audio projector reads encoder_ffn_dim // 4 features from a d_model-wide encoder
    assert audio["encoder_ffn_dim"] == 4 * audio["d_model"]
    assert audio["max_source_positions"] == 1500  # the streaming KV reset rule
    assert audio["num_mel_bins"] == 80
    vision = config["vision_config"]
    assert (vision["patch_size"], vision["image_size"]) == (14, 980)
    assert vision["num_hidden_layers"] >= 2  # the reference drops the last one
    tts = config["tts_config"]
    assert tts["llm_dim"] == config["hidden_size"]
    assert tts["num_audio_tokens"] == 6562  # EOS 6561; the vocoder's silence 4218 stays valid
    assert tts["num_vq"] == 1
    assert (tts["backbone_model"], tts["projector_type"]) == ("llama", "mlp")
    assert tts["hidden_size"] % tts["num_attention_heads"] == 0
    assert (config["query_num"], config["audio_pool_step"], config["audio_chunk_length"]) == (
        64,
        5,
        1.0,
    )


def test_the_tokenizer_has_every_released_special_token_at_a_small_id(checkpoint):
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    added = {int(k): v for k, v in tokenizer_config["added_tokens_decoder"].items()}
    # the byte-level alphabet first, then the added tokens, filling the LLM's vocabulary
    assert min(added) >= 256
    assert sorted(added) == list(range(min(added), config["vocab_size"]))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == config["vocab_size"]
    ids = [tokenizer.token_to_id(name) for name in DUPLEX_TOKENS]
    assert ids == sorted(ids)  # the released order kept
    for name, token_id in zip(DUPLEX_TOKENS, ids, strict=True):
        assert added[token_id]["content"] == name
        assert added[token_id]["special"] is True
        assert tokenizer.encode(name, add_special_tokens=False).ids == [token_id]
    # the config's token ids name the same tokens
    assert config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    assert config["tts_config"]["audio_bos_token_id"] == tokenizer.token_to_id("<focus>")
    assert config["tts_config"]["audio_bos_token_id"] < config["tts_config"]["num_text_tokens"]
    assert config["tts_config"]["num_text_tokens"] == config["vocab_size"]
    # the decoder's forbidden list exists and names real tokens
    assert tokenizer_config["tokenizer_class"] == "MiniCPMOTokenizerFast"
    assert 0 < len(tokenizer_config["bad_token_ids"]) < 20
    assert all(0 <= i < 256 for i in tokenizer_config["bad_token_ids"])


def test_text_round_trips_and_specials_drop_out_when_asked(checkpoint):
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    text = "<|im_start|>system\nStreaming Omni Conversation, 1 s units.\n<|audio_start|>"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == "system\nStreaming Omni Conversation, 1 s units.\n"
    # non-ASCII text goes through the byte tokens
    assert tokenizer.decode(tokenizer.encode("héllo 语音").ids) == "héllo 语音"


def expected_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The reference MiniCPMO's state dict for this config, by the arithmetic of its modules:
    Qwen3ForCausalLM (llm.), NaViT SigLIP without its last layer (vpm.), the resampler, the
    Whisper encoder (apm.) and its projector, and MiniCPMTTS on a LlamaModel (tts.)."""
    d = config["hidden_size"]
    expected = {
        "llm.model.embed_tokens.weight": (config["vocab_size"], d),
        "llm.model.norm.weight": (d,),
        "llm.lm_head.weight": (config["vocab_size"], d),
    }

    def linear(prefix: str, out: int, inp: int, bias: bool = True) -> None:
        expected[f"{prefix}.weight"] = (out, inp)
        if bias:
            expected[f"{prefix}.bias"] = (out,)

    def layer_norm(prefix: str, width: int) -> None:
        expected[f"{prefix}.weight"] = (width,)
        expected[f"{prefix}.bias"] = (width,)

    def llama_layer(prefix: str, width: int, heads: int, kv_heads: int, head: int, ffn: int):
        linear(f"{prefix}.self_attn.q_proj", heads * head, width, bias=False)
        linear(f"{prefix}.self_attn.k_proj", kv_heads * head, width, bias=False)
        linear(f"{prefix}.self_attn.v_proj", kv_heads * head, width, bias=False)
        linear(f"{prefix}.self_attn.o_proj", width, heads * head, bias=False)
        linear(f"{prefix}.mlp.gate_proj", ffn, width, bias=False)
        linear(f"{prefix}.mlp.up_proj", ffn, width, bias=False)
        linear(f"{prefix}.mlp.down_proj", width, ffn, bias=False)
        expected[f"{prefix}.input_layernorm.weight"] = (width,)
        expected[f"{prefix}.post_attention_layernorm.weight"] = (width,)

    for i in range(config["num_hidden_layers"]):
        llama_layer(
            f"llm.model.layers.{i}",
            d,
            config["num_attention_heads"],
            config["num_key_value_heads"],
            config["head_dim"],
            config["intermediate_size"],
        )
        expected[f"llm.model.layers.{i}.self_attn.q_norm.weight"] = (config["head_dim"],)
        expected[f"llm.model.layers.{i}.self_attn.k_norm.weight"] = (config["head_dim"],)

    v = config["vision_config"]
    vd, patch = v["hidden_size"], v["patch_size"]
    expected["vpm.embeddings.patch_embedding.weight"] = (vd, v["num_channels"], patch, patch)
    expected["vpm.embeddings.patch_embedding.bias"] = (vd,)
    expected["vpm.embeddings.position_embedding.weight"] = ((v["image_size"] // patch) ** 2, vd)
    for i in range(v["num_hidden_layers"] - 1):
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(f"vpm.encoder.layers.{i}.self_attn.{proj}", vd, vd)
        layer_norm(f"vpm.encoder.layers.{i}.layer_norm1", vd)
        layer_norm(f"vpm.encoder.layers.{i}.layer_norm2", vd)
        linear(f"vpm.encoder.layers.{i}.mlp.fc1", v["intermediate_size"], vd)
        linear(f"vpm.encoder.layers.{i}.mlp.fc2", vd, v["intermediate_size"])
    layer_norm("vpm.post_layernorm", vd)

    expected["resampler.query"] = (config["query_num"], d)
    linear("resampler.kv_proj", d, vd, bias=False)
    expected["resampler.attn.in_proj_weight"] = (3 * d, d)
    expected["resampler.attn.in_proj_bias"] = (3 * d,)
    linear("resampler.attn.out_proj", d, d)
    for norm in ("ln_q", "ln_kv", "ln_post"):
        layer_norm(f"resampler.{norm}", d)
    expected["resampler.proj"] = (d, d)

    a = config["audio_config"]
    ad = a["d_model"]
    expected["apm.conv1.weight"] = (ad, a["num_mel_bins"], 3)
    expected["apm.conv1.bias"] = (ad,)
    expected["apm.conv2.weight"] = (ad, ad, 3)
    expected["apm.conv2.bias"] = (ad,)
    expected["apm.embed_positions.weight"] = (a["max_source_positions"], ad)
    for i in range(a["encoder_layers"]):
        linear(f"apm.layers.{i}.self_attn.k_proj", ad, ad, bias=False)
        for proj in ("q_proj", "v_proj", "out_proj"):
            linear(f"apm.layers.{i}.self_attn.{proj}", ad, ad)
        layer_norm(f"apm.layers.{i}.self_attn_layer_norm", ad)
        layer_norm(f"apm.layers.{i}.final_layer_norm", ad)
        linear(f"apm.layers.{i}.fc1", a["encoder_ffn_dim"], ad)
        linear(f"apm.layers.{i}.fc2", ad, a["encoder_ffn_dim"])
    layer_norm("apm.layer_norm", ad)
    linear("audio_projection_layer.linear1", d, a["encoder_ffn_dim"] // 4)
    linear("audio_projection_layer.linear2", d, d)

    t = config["tts_config"]
    td, heads = t["hidden_size"], t["num_attention_heads"]
    expected["tts.emb_text.weight"] = (t["num_text_tokens"], td)
    expected["tts.model.embed_tokens.weight"] = (32000, td)  # LlamaConfig's default vocabulary
    expected["tts.model.norm.weight"] = (td,)
    for i in range(t["num_hidden_layers"]):
        llama_layer(
            f"tts.model.layers.{i}",
            td,
            heads,
            t["num_key_value_heads"],
            td // heads,
            t["intermediate_size"],
        )
    for projector in ("projector_spk", "projector_semantic"):
        linear(f"tts.{projector}.linear1", td, t["llm_dim"])
        linear(f"tts.{projector}.linear2", td, td)
    for k in range(t["num_vq"]):
        expected[f"tts.emb_code.{k}.weight"] = (t["num_audio_tokens"], td)
        weight = f"tts.head_code.{k}.parametrizations.weight"
        expected[f"{weight}.original0"] = (t["num_audio_tokens"], 1)  # weight_norm's g
        expected[f"{weight}.original1"] = (t["num_audio_tokens"], td)  # and v
    return expected


def test_every_reference_parameter_is_stored_under_its_published_name(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected_parameters(config)
    assert {t.dtype for t in tensors.values()} == {np.dtype("float32")}
    assert all(np.isfinite(t).all() for t in tensors.values())
    # weight norm: positive gains, nonzero directions
    gains = tensors["tts.head_code.0.parametrizations.weight.original0"]
    directions = tensors["tts.head_code.0.parametrizations.weight.original1"]
    assert (gains > 0).all()
    assert (np.abs(directions).sum(axis=1) > 0).all()


def test_the_checkpoint_is_small(checkpoint):
    size = sum((checkpoint / name).stat().st_size for name in FILES)
    assert size < 8 * 2**20
