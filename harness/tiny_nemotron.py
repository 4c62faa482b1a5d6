"""A tiny random Nemotron VoiceChat checkpoint, for the tests and the CPU benchmarks
(plugins/nemotron).

It is the published checkpoint's layout at toy sizes (`checkpoint.py` loads both alike):

    <dir>/config.json                      NeMo's NemotronVoiceChat config (model/data)
    <dir>/model.safetensors                every weight (save_pretrained's file)
    <dir>/NVIDIA-Nemotron-H-tiny/          the LLM's HF config and tokenizer (the published
                                           checkpoint names a hub id there; ours is local)

Sizes: a 4-layer Nemotron-H (Mamba-2, MLP, attention, Mamba-2; hidden 64), a 2-layer
cache-aware streaming FastConformer (causal convolutions, left context only, 8x
subsampling: one 80 ms frame is one encoder step), a 1-layer Gemma-3 EAR-TTS backbone and
a small RVQ-VAE codec that still turns 31 codes into 1764 samples at 22.05 kHz. The
tokenizer is a byte-level BPE of 300 tokens trained here with `tokenizers`, with the
special tokens the model and our tool calls use. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LLM_DIRNAME = "NVIDIA-Nemotron-H-tiny"
SPEAKER_FILE = "speaker.wav"
_PERCEPTION = "nemo.collections.speechlm2.modules.perception"
_ASR = "nemo.collections.asr.modules"
#: the text channel's embeddings and the user channel's projection: at NeMo's own init
#: scales a random model says one token forever; at these it says varied things, and
#: talks on most frames (the tests script the quiet they need: tests/plugins/nemotron/scripted.py)
TEXT_EMBED_STD = 0.5
USER_PROJ_STD = 1.0
SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "<SPECIAL_12>",
    "<TOOLCALL>",
    "</TOOLCALL>",
    "<AVAILABLE_TOOLS>",
    "</AVAILABLE_TOOLS>",
    "<TOOL_RESPONSE>",
    "</TOOL_RESPONSE>",
)
_CORPUS = (
    "hello there how are you today the weather is sunny and warm in paris",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} {"temperature": 21}',
    "you are a helpful voice assistant answer briefly and call tools when needed",
)


def _write_llm(directory: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import NemotronHConfig, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<SPECIAL_12>",
    )
    fast.save_pretrained(directory)
    NemotronHConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        hybrid_override_pattern="M-*M",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        conv_kernel=4,
        expand=1,
        chunk_size=16,
    ).save_pretrained(directory)


def tiny_config(llm_dir: str, speech_window: int | None = None) -> dict[str, Any]:
    """NemotronVoiceChat's config at toy sizes (the layout of NeMo's own parity tests).
    `speech_window`: the speech decoder's backbone gets a second layer, of full attention,
    beside its sliding-window one, and that window (Gemma-3's mix, at a size a test crosses)."""
    log_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), "nemotron-tiny-logs")
    config: dict[str, Any] = {
        "model": {
            "scoring_asr": "stt_en_fastconformer_transducer_large",
            "stt": {
                "model": {
                    "pretrained_llm": llm_dir,
                    "tokenizer_path": llm_dir,
                    "pretrained_weights": False,
                    "trust_remote_code": False,
                    "embed_tokens_attr_name": "embeddings",
                    "predict_user_text": True,
                    "source_sample_rate": 16000,
                    "validation_save_path": log_dir,
                    "perception": {
                        "_target_": f"{_PERCEPTION}.AudioPerceptionModule",
                        "preprocessor": {
                            "_target_": f"{_ASR}.AudioToMelSpectrogramPreprocessor",
                            "features": 16,
                            "normalize": "NA",
                            "dither": 0.0,
                            "pad_to": 0,
                        },
                        "encoder": {
                            "_target_": f"{_ASR}.ConformerEncoder",
                            "feat_in": 16,
                            "d_model": 32,
                            "n_heads": 2,
                            "n_layers": 2,
                            "subsampling_factor": 8,
                            "subsampling_conv_channels": 16,
                            "ff_expansion_factor": 2,
                            "conv_kernel_size": 5,
                            "self_attention_model": "rel_pos",
                            "att_context_size": [16, 0],
                            "att_context_style": "regular",
                            "conv_context_size": "causal",
                            "causal_downsampling": True,
                            "subsampling": "dw_striding",
                            "dropout": 0.0,
                            "dropout_pre_encoder": 0.0,
                            "dropout_emb": 0.0,
                            "dropout_att": 0.0,
                        },
                        "modality_adapter": {
                            "_target_": f"{_PERCEPTION}.IdentityConnector",
                            "d_model": 32,
                        },
                        "output_dim": 64,
                    },
                    "optimizer": {"_target_": "torch.optim.AdamW"},
                },
                "data": {"source_sample_rate": 16000},
                "exp_manager": {"explicit_log_dir": log_dir},
            },
            "speech_generation": {
                "model": {
                    "pretrained_lm_name": llm_dir,
                    "pretrained_ae_dir": None,
                    "pretrained_tts_model": None,
                    "scoring_asr": "stt_en_fastconformer_transducer_large",
                    "freeze_params": [],
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "pad_token": "<SPECIAL_12>",
                    "audio_codec_run_dtype": "float32",
                    "prevent_freeze_params": [],
                    "audio_save_path": "",
                    "inference_guidance_scale": 0.5,
                    "inference_noise_scale": 0.0,
                    "inference_top_p_or_k": 1,
                    "inference_guidance_enabled": False,
                    "subword_mask_exactly_as_eartts": False,
                    "context_hidden_mask_exactly_as_eartts": False,
                    "optimizer": {"_target_": "torch.optim.AdamW"},
                    "codec_config": {
                        "latent_size": 32,
                        "n_fft": 16,
                        "hop_length": 4,
                        "base_hidden_size": 16,
                        "channel_mult": [1, 2, 4],
                        "rates": [7, 7, 9],
                        "num_blocks": 1,
                        "kernel_size": 7,
                        "groups": 1,
                        "codebook_size": 64,
                        "num_quantizers": 31,
                        "wav_to_token_ratio": 1764,
                    },
                    "tts_config": {
                        "use_gated_fusion_for_text_audio": True,
                        "disable_eos_prediction": True,
                        "use_bos_eos_emb": True,
                        "use_subword_flag_emb": True,
                        "num_delay_speech_tokens": 2,
                        "backbone_type": "gemma3_text",
                        "backbone_model_class": None,
                        "backbone_config_class": None,
                        "backbone_config": {
                            "hidden_size": 64,
                            "intermediate_size": 128,
                            "num_hidden_layers": 1,
                            "num_attention_heads": 2,
                            "num_key_value_heads": 2,
                            "head_dim": 32,
                            "attention_dropout": 0.0,
                            "use_cache": False,
                        },
                        "latent_size": 32,
                        "codebook_size": 64,
                        "num_quantizers": 31,
                        "context_hidden_size": None,
                        "cas_config": {
                            "backbone_type": "t5gemma",
                            "backbone_model_class": None,
                            "backbone_config_class": None,
                            "backbone_config": {
                                "is_encoder_decoder": False,
                                "encoder": {
                                    "hidden_size": 64,
                                    "intermediate_size": 128,
                                    "num_hidden_layers": 1,
                                    "num_attention_heads": 2,
                                    "num_key_value_heads": 2,
                                    "head_dim": 32,
                                    "use_cache": False,
                                    "attention_dropout": 0.0,
                                },
                            },
                        },
                        "mog_head_config": {
                            "intermediate_size": 128,
                            "num_layers": 2,
                            "low_rank": 16,
                            "num_predictions": 64,
                            "min_log_std": -4.0,
                            "eps": 1e-6,
                        },
                        "p_uncond": 0.1,
                        "label_smoothing": 0.01,
                        "max_training_rate": 0.8,
                        "quantizer_dropout": 0.5,
                        "random_target_masking": False,
                        "exponent": 3.0,
                    },
                },
                "data": {
                    "add_text_bos_and_eos_in_each_turn": True,
                    "add_audio_prompt": True,
                    "audio_prompt_duration": 3.0,
                    "frame_length": 0.08,
                    "source_sample_rate": 16000,
                    "target_sample_rate": 22050,
                },
                "exp_manager": {"explicit_log_dir": log_dir},
            },
        },
        "data": {
            "frame_length": 0.08,
            "source_sample_rate": 16000,
            "target_sample_rate": 22050,
            "input_roles": ["user", "User"],
            "output_roles": ["agent", "Assistant", "assistant", "Agent"],
        },
        "exp_manager": {"explicit_log_dir": log_dir},
    }
    return _with_speech_window(config, speech_window)


def _with_speech_window(config: dict[str, Any], window: int | None) -> dict[str, Any]:
    if window is not None:
        backbone = config["model"]["speech_generation"]["model"]["tts_config"]["backbone_config"]
        backbone["num_hidden_layers"] = 2
        backbone["layer_types"] = ["sliding_attention", "full_attention"]
        backbone["sliding_window"] = window
    return config


def build_tiny_checkpoint(
    directory: str | os.PathLike[str], seed: int = 0, speech_window: int | None = None
) -> Path:
    """Write a tiny random checkpoint to `directory` (created) and return it."""
    import torch
    from nemo.collections.speechlm2.models import NemotronVoiceChat

    root = Path(directory)
    llm_dir = root / LLM_DIRNAME
    llm_dir.mkdir(parents=True, exist_ok=True)
    _write_llm(llm_dir, seed)
    config = tiny_config(str(llm_dir), speech_window)
    torch.manual_seed(seed)
    model = NemotronVoiceChat(config)
    # a function channel that never calls (the tests script its tokens): the head the
    # published checkpoint's function channel is read from (checkpoint.FUNCTION_HEAD)
    hidden = model.stt_model.lm_head.in_features
    vocab = model.stt_model.lm_head.out_features
    model.stt_model.function_head = torch.nn.Linear(hidden, vocab)
    with torch.no_grad():
        model.stt_model.function_head.weight.zero_()
        model.stt_model.function_head.bias.fill_(-10.0)
        model.stt_model.function_head.bias[model.stt_model.text_pad_id] = 10.0
    # NeMo's random init leaves some weights at scales that saturate a toy model (every
    # frame the same token): rescale what a tiny model needs to say varied things
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lm_head.weight") or name.endswith("asr_head.weight"):
                param.normal_(0.0, 0.5)
            elif "embed_tokens" in name or "embed_asr_tokens" in name:
                param.normal_(0.0, TEXT_EMBED_STD)
            elif name.startswith("stt_model.perception.proj"):
                param.normal_(0.0, USER_PROJ_STD)
    model.save_pretrained(str(root))
    import numpy as np
    import soundfile

    voice = np.random.default_rng(seed).standard_normal(22050).astype(np.float32) * 0.1
    soundfile.write(root / SPEAKER_FILE, voice, 22050)
    # the config as published: the LLM and tokenizer named by a path relative to the
    # checkpoint, resolved by checkpoint.py
    config = tiny_config(LLM_DIRNAME, speech_window)
    config["model"]["inference_speaker_reference"] = SPEAKER_FILE
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return root


__all__ = ["LLM_DIRNAME", "SPECIAL_TOKENS", "build_tiny_checkpoint", "tiny_config"]
