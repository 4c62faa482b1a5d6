"""A local Moshi-family checkpoint directory, loaded with kyutai's own `moshi.models.loaders`.

The directory is laid out as the Hugging Face repositories are (kyutai/moshiko-pytorch-bf16,
nvidia/personaplex-7b-v1): `model.safetensors` (the LM), `tokenizer-e351c8d8-checkpoint125
.safetensors` (Mimi), `tokenizer_spm_32k_3.model` (the text tokenizer) and an optional
`config.json` with the LM's kwargs and moshi's own keys (`moshi_name`, `mimi_name`,
`tokenizer_name`, `lora_name`, `mimi_config_name`, `model_type`, `lm_gen_config`). A
`config.json` without LM kwargs (no `dim`) means moshi's 7B defaults, as upstream.

Keys of ours: `"preset"` (`moshi` or `personaplex`), `"personaplex"` (that preset's
settings, plugins/moshi/personaplex.py) and `"mimi"`, a dict deep-merged over moshi's
default Mimi config (`loaders._mimi_config`: `seanet`, `quantizer`, `transformer`, ...),
so that a small Mimi (the tests' tiny model) is built by the very construction
`loaders.get_mimi` does. Upstream's `mimi_config_name` (a whole Mimi config as a JSON file
in the directory) works too.

Nothing is ever downloaded: we build `CheckpointInfo` from local paths ourselves (its
`from_hf_repo` calls `hf_hub_download`), and a missing or malformed directory is a
`CheckpointError` naming what is wrong, raised when the worker starts.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sentencepiece
import torch
from moshi.models import loaders
from moshi.models.compression import MimiModel
from moshi.models.lm import LMModel

CONFIG_NAME = "config.json"
#: our config.json key: overrides of moshi's default Mimi config (see the module doc)
MIMI_OVERRIDES_KEY = "mimi"
#: config.json keys of ours, never LMModel kwargs: Mimi overrides, the preset, its settings
OUR_KEYS = (MIMI_OVERRIDES_KEY, "preset", "personaplex")
#: config.json keys that are moshi's loader settings, not LMModel kwargs (as from_hf_repo)
_LOADER_KEYS = (
    "moshi_name",
    "mimi_name",
    "mimi_config_name",
    "tokenizer_name",
    "lora_name",
    "model_type",
    "lm_gen_config",
    "tts_config",
    "stt_config",
    "model_id",
)


class CheckpointError(ValueError):
    """The model directory cannot be loaded: the message names the file or key at fault."""


def deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` applied key by key, recursing into dicts on both sides."""
    merged = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable {what} ({error})") from error
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object")
    return value


def _file_in(directory: Path, name: Any, role: str) -> Path:
    """`directory/name`, for a plain file name (a checkpoint never points outside itself)."""
    if not isinstance(name, str) or not name or Path(name).name != name:
        raise CheckpointError(
            f"{directory / CONFIG_NAME}: {role} must be a file name, got {name!r}"
        )
    return directory / name


@dataclasses.dataclass(frozen=True)
class MoshiCheckpoint:
    """A checked checkpoint directory and moshi's `CheckpointInfo` for it."""

    directory: Path
    info: loaders.CheckpointInfo
    #: the whole config.json ({} when absent): presets read their own keys from it
    raw_config: dict[str, Any]

    @classmethod
    def open(cls, directory: str | Path) -> MoshiCheckpoint:
        path = Path(directory)
        if not path.is_dir():
            raise CheckpointError(f"model_dir {str(path)!r} is not a directory")
        raw = _read_json(path / CONFIG_NAME, "config") if (path / CONFIG_NAME).exists() else {}
        lm_config = {k: v for k, v in raw.items() if k not in _LOADER_KEYS + OUR_KEYS}
        mimi_overrides = raw.get(MIMI_OVERRIDES_KEY)
        # a config.json with loader keys only (no LM kwargs) means moshi's 7B, as upstream
        lm_kwargs = lm_config if "dim" in lm_config else None
        model_type = raw.get("model_type", "moshi")
        if model_type != "moshi":
            raise CheckpointError(
                f"{path / CONFIG_NAME}: model_type {model_type!r} is not a full-duplex "
                "conversation model (only 'moshi' is)"
            )
        if lm_kwargs and ("conditioners" in lm_kwargs or lm_kwargs.get("fuser")):
            raise CheckpointError(
                f"{path / CONFIG_NAME}: conditioned LMs (conditioners/fuser) are not supported"
            )
        files = {
            "the LM weights": _file_in(
                path, raw.get("moshi_name", loaders.MOSHI_NAME), "moshi_name"
            ),
            "the Mimi weights": _file_in(
                path, raw.get("mimi_name", loaders.MIMI_NAME), "mimi_name"
            ),
            "the text tokenizer": _file_in(
                path, raw.get("tokenizer_name", loaders.TEXT_TOKENIZER_NAME), "tokenizer_name"
            ),
        }
        if raw.get("lora_name"):
            files["the LoRA weights"] = _file_in(path, raw["lora_name"], "lora_name")
        mimi_config = None
        if raw.get("mimi_config_name"):
            files["the Mimi config"] = _file_in(path, raw["mimi_config_name"], "mimi_config_name")
        missing = [f"{file.name} ({role})" for role, file in files.items() if not file.is_file()]
        if missing:
            raise CheckpointError(f"model_dir {str(path)!r} lacks {', '.join(missing)}")
        if "the Mimi config" in files:
            mimi_config = _read_json(files["the Mimi config"], "Mimi config")
        elif mimi_overrides is not None:
            if not isinstance(mimi_overrides, dict):
                raise CheckpointError(
                    f"{path / CONFIG_NAME}: {MIMI_OVERRIDES_KEY!r} must be a dict"
                )
            mimi_config = deep_merge(loaders._mimi_config, mimi_overrides)
        lm_gen_config = raw.get("lm_gen_config", {})
        if not isinstance(lm_gen_config, dict):
            raise CheckpointError(f"{path / CONFIG_NAME}: lm_gen_config must be a dict")
        info = loaders.CheckpointInfo(
            moshi_weights=files["the LM weights"],
            mimi_weights=files["the Mimi weights"],
            tokenizer=files["the text tokenizer"],
            lm_config=lm_kwargs,
            raw_config=raw or None,
            mimi_config=mimi_config,
            model_type="moshi",
            lora_weights=files.get("the LoRA weights"),
            lm_gen_config=lm_gen_config,
        )
        return cls(path, info, raw)

    def load_lm(self, device: torch.device, dtype: torch.dtype) -> LMModel:
        try:
            return self.info.get_moshi(device=device, dtype=dtype)
        except (RuntimeError, KeyError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"{self.info.moshi_weights}: does not match the LM config ({error})"
            ) from error

    def load_mimi(self, device: torch.device) -> MimiModel:
        try:
            return self.info.get_mimi(device=device)
        except (RuntimeError, KeyError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"{self.info.mimi_weights}: does not match the Mimi config ({error})"
            ) from error

    def load_tokenizer(self) -> sentencepiece.SentencePieceProcessor:
        try:
            return self.info.get_text_tokenizer()
        except (OSError, RuntimeError) as error:
            raise CheckpointError(
                f"{self.info.tokenizer}: not a sentencepiece model ({error})"
            ) from error


__all__ = ["CONFIG_NAME", "MIMI_OVERRIDES_KEY", "CheckpointError", "MoshiCheckpoint", "deep_merge"]
