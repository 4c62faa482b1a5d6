"""What a MiniCPM-o 4.5 checkpoint's `config.json` says about its language model and its
speech-token model, read into typed values and checked.

The published checkpoint (`openbmb/MiniCPM-o-4_5`) keeps one `config.json`: the Qwen3
fields of its language model at the top level, with `audio_config` (a Whisper encoder),
`vision_config` (SigLIP) and `tts_config` (the Llama-based speech-token model) nested in
it. The audio and vision parts read their own sections (`audio.AudioConfig`,
`vision.VisionConfig`); this module holds the language model's and the speech-token
model's, and the file's reading. Sizes always come from the file: the tiny checkpoints of
the tests and the real 8B model go through the same code.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

#: what the reference's speech-token model builds its Llama backbone with: only the sizes
#: come from `tts_config`, the rest are `LlamaConfig`'s defaults (its RoPE base and norm
#: epsilon are not in the file, so a checkpoint cannot change them)
LLAMA_DEFAULT_ROPE_THETA = 10000.0
LLAMA_DEFAULT_RMS_EPS = 1e-6


class ModelDirError(ValueError):
    """A model directory that is not a MiniCPM-o 4.5 checkpoint we can serve: what is
    missing or inconsistent, said plainly (a worker refuses to start with it)."""


def _int(section: dict[str, Any], key: str, where: str) -> int:
    value = section.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelDirError(f"{where}.{key} must be a positive integer, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class LanguageConfig:
    """The Qwen3 language model (the backbone that hears, sees and decides)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    tie_word_embeddings: bool

    @classmethod
    def from_json(cls, config: dict[str, Any]) -> LanguageConfig:
        heads = _int(config, "num_attention_heads", "config")
        hidden = _int(config, "hidden_size", "config")
        head_dim = config.get("head_dim") or hidden // heads
        rope = config.get("rope_theta")
        if rope is None:  # the transformers 5 spelling of the same number
            rope = (config.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        kv_heads = _int(config, "num_key_value_heads", "config")
        if heads % kv_heads:
            raise ModelDirError(
                f"config: {heads} attention heads do not group over {kv_heads} key/value heads"
            )
        if hidden % 128:
            # the resampler attends with hidden/128 heads (the reference's rule): a hidden
            # size that is not a multiple of 128 is not a MiniCPM-o checkpoint
            raise ModelDirError(f"config.hidden_size must be a multiple of 128, got {hidden}")
        return cls(
            hidden_size=hidden,
            num_layers=_int(config, "num_hidden_layers", "config"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            intermediate_size=_int(config, "intermediate_size", "config"),
            vocab_size=_int(config, "vocab_size", "config"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope),
            max_positions=_int(config, "max_position_embeddings", "config"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )


@dataclasses.dataclass(frozen=True)
class SpeechConfig:
    """The speech-token model (the reference's `MiniCPMTTS`): a Llama backbone that turns
    what the language model says (its tokens and hidden states) into 25 Hz codec tokens."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_positions: int
    llm_dim: int
    num_audio_tokens: int
    num_text_tokens: int
    audio_bos_token_id: int
    num_vq: int
    rope_theta: float = LLAMA_DEFAULT_ROPE_THETA
    rms_norm_eps: float = LLAMA_DEFAULT_RMS_EPS

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def eos_code(self) -> int:
        """The codec token that ends a turn's speech: the last one."""
        return self.num_audio_tokens - 1

    @classmethod
    def from_json(cls, config: dict[str, Any], language: LanguageConfig) -> SpeechConfig:
        tts = config.get("tts_config")
        if not isinstance(tts, dict):
            raise ModelDirError("config.tts_config is missing: not a MiniCPM-o 4.5 checkpoint")
        where = "config.tts_config"
        for key, wanted in (("backbone_model", "llama"), ("projector_type", "mlp")):
            if tts.get(key, wanted) != wanted:
                raise ModelDirError(f"{where}.{key} is {tts.get(key)!r}; we serve {wanted!r}")
        speech = cls(
            hidden_size=_int(tts, "hidden_size", where),
            num_layers=_int(tts, "num_hidden_layers", where),
            num_heads=_int(tts, "num_attention_heads", where),
            num_kv_heads=_int(tts, "num_key_value_heads", where),
            intermediate_size=_int(tts, "intermediate_size", where),
            max_positions=_int(tts, "max_position_embeddings", where),
            llm_dim=_int(tts, "llm_dim", where),
            num_audio_tokens=_int(tts, "num_audio_tokens", where),
            num_text_tokens=_int(tts, "num_text_tokens", where),
            audio_bos_token_id=_int(tts, "audio_bos_token_id", where),
            num_vq=_int(tts, "num_vq", where),
        )
        if speech.num_vq != 1:
            raise ModelDirError(f"{where}.num_vq is {speech.num_vq}; the duplex loop uses 1")
        if speech.llm_dim != language.hidden_size:
            raise ModelDirError(
                f"{where}.llm_dim ({speech.llm_dim}) is not the language model's hidden size "
                f"({language.hidden_size})"
            )
        if speech.audio_bos_token_id >= speech.num_text_tokens:
            raise ModelDirError(f"{where}.audio_bos_token_id is outside num_text_tokens")
        if speech.hidden_size % speech.num_heads:
            raise ModelDirError(f"{where}.hidden_size does not split over its heads")
        return speech


def read_config(model_dir: Path) -> dict[str, Any]:
    """`config.json` of a model directory, as a dict (ModelDirError when it is not there
    or not a MiniCPM-o 4.5 config)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelDirError(
            f"{path} is missing: point --model-dir at a MiniCPM-o-4_5 download"
        ) from None
    except json.JSONDecodeError as exc:
        raise ModelDirError(f"{path} is not JSON: {exc}") from None
    if not isinstance(config, dict) or config.get("model_type") != "minicpmo":
        raise ModelDirError(f"{path} is not a MiniCPM-o config (model_type must be 'minicpmo')")
    return config


__all__ = [
    "LanguageConfig",
    "ModelDirError",
    "SpeechConfig",
    "read_config",
]
