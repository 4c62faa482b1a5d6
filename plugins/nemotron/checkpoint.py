"""Loading a Nemotron VoiceChat checkpoint from a local directory (never downloaded).

The published checkpoint (`nvidia/NVIDIA-NemotronLabs-VoiceChat-11B`) is NeMo's
`save_pretrained` layout:

- `config.json`: NemotronVoiceChat's config (`model.stt.model` the duplex STT model with its
  perception and LLM, `model.speech_generation` the EAR-TTS decoder and codec, `data` the
  rates and frame length);
- `model.safetensors`: every weight of the three (NeMo's streaming loader reads it tensor by
  tensor, `NemotronVoiceChat.init_from_safetensors_ckpt`).

The config names the LLM and its tokenizer by hub id (`pretrained_llm`, `tokenizer_path`,
the TTS's `pretrained_lm_name`): the architecture is built from that LLM's `config.json`
with random weights, then every weight comes from `model.safetensors`. Here nothing is
downloaded: each name must be a directory inside the checkpoint (the id's last part,
`nvidia/NVIDIA-Nemotron-Nano-9B-v2` -> `<dir>/NVIDIA-Nemotron-Nano-9B-v2/`, holding the
LLM's `config.json` and tokenizer files) or an existing absolute path. The check runs when
the worker starts (`inspect`), so a wrong directory fails there, with what is missing.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: the function channel's head: nemo-toolkit 3.0.0's DuplexSTTModel has none, NVIDIA's
#: streaming branch adds one; a checkpoint whose weights hold it gets it (plugin docs)
FUNCTION_HEAD = "stt_model.function_head"


class CheckpointError(ValueError):
    """The directory is not a loadable Nemotron VoiceChat checkpoint (what is missing)."""


@dataclasses.dataclass(frozen=True)
class NemotronCheckpoint:
    """A checked checkpoint directory and its config with local paths resolved."""

    directory: Path
    config: dict[str, Any]

    @property
    def source_sample_rate(self) -> int:
        return int(self.config["data"]["source_sample_rate"])

    @property
    def target_sample_rate(self) -> int:
        return int(self.config["data"]["target_sample_rate"])

    @property
    def frame_length_s(self) -> float:
        return float(self.config["data"]["frame_length"])

    @classmethod
    def inspect(cls, directory: str | os.PathLike[str]) -> NemotronCheckpoint:
        """Check the layout (no weight is read); raise `CheckpointError` saying what is wrong."""
        root = Path(directory).expanduser()
        if not root.is_dir():
            raise CheckpointError(f"nemotron checkpoint directory {str(root)!r} does not exist")
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (root / name).is_file():
                raise CheckpointError(
                    f"{str(root)!r} is not a Nemotron VoiceChat checkpoint: no {name} "
                    f"(expected NeMo's save_pretrained layout: {CONFIG_FILE} + {WEIGHTS_FILE})"
                )
        try:
            raw = json.loads((root / CONFIG_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{root / CONFIG_FILE} is not readable JSON: {exc}") from None
        try:
            model = raw["model"]
            stt, tts, data = model["stt"]["model"], model["speech_generation"], raw["data"]
            int(data["source_sample_rate"]), int(data["target_sample_rate"])
            float(data["frame_length"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(
                f"{root / CONFIG_FILE} is not a NemotronVoiceChat config (missing {exc})"
            ) from None
        config = copy.deepcopy(raw)
        stt = config["model"]["stt"]["model"]
        tts = config["model"]["speech_generation"]["model"]
        stt["pretrained_llm"] = _local(
            root, stt.get("pretrained_llm"), "model.stt.model.pretrained_llm"
        )
        stt["tokenizer_path"] = _local(
            root,
            stt.get("tokenizer_path") or stt["pretrained_llm"],
            "model.stt.model.tokenizer_path",
        )
        tts["pretrained_lm_name"] = _local(
            root,
            tts.get("tokenizer_path") or tts.get("pretrained_lm_name"),
            "model.speech_generation.model.pretrained_lm_name",
        )
        if tts.get("tokenizer_path"):
            tts["tokenizer_path"] = tts["pretrained_lm_name"]
        # every weight comes from model.safetensors: nothing pretrained is fetched or read
        config["pretrained_weights"] = False
        stt["pretrained_weights"] = False
        stt["pretrained_s2s_model"] = None
        stt.pop("pretrained_asr", None)
        for key in ("pretrained_model", "pretrained_codec_model", "pretrained_tts_model"):
            tts[key] = None
        tts["pretrained_ae_dir"] = None
        speaker = config["model"].get("inference_speaker_reference")
        if (
            not config["model"].get("inference_speaker_name")
            and isinstance(speaker, str)
            and speaker
        ):
            path = Path(speaker) if Path(speaker).is_absolute() else root / speaker
            if not path.is_file():
                raise CheckpointError(
                    f"model.inference_speaker_reference is {speaker!r}: no such file (looked "
                    f"for {path})"
                )
            config["model"]["inference_speaker_reference"] = str(path)
        elif not config["model"].get("inference_speaker_name"):
            raise CheckpointError(
                f"{root / CONFIG_FILE} names no voice: set model.inference_speaker_name (a "
                "speaker registered in the weights) or model.inference_speaker_reference (a "
                "wav file in the checkpoint directory)"
            )
        if "Nemotron" not in stt["pretrained_llm"]:
            # NeMo picks the Nemotron-H path (its cache keyword) by this name
            raise CheckpointError(
                f"model.stt.model.pretrained_llm resolves to {stt['pretrained_llm']!r}: the "
                "directory name must say Nemotron (NeMo selects Nemotron-H's code path by it)"
            )
        return cls(root, config)

    def _add_function_head(self, model: Any) -> None:
        """A Linear head for the function channel where the weights have one."""
        import torch

        found = _function_head_shape(self.directory / WEIGHTS_FILE)
        if found is None:
            model.stt_model.function_head = None  # the text channel carries the calls
            return
        (out_features, in_features), bias = found
        model.stt_model.function_head = torch.nn.Linear(in_features, out_features, bias=bias)

    def speaker_audio(self, rate: int) -> Any:
        """The speaker reference (model.inference_speaker_reference) as [1, samples] at `rate`."""
        import librosa
        import torch

        path = self.config["model"]["inference_speaker_reference"]
        audio, _ = librosa.load(path, sr=rate, mono=True)
        return torch.from_numpy(audio).float()[None]

    def load(self, device: str = "cpu") -> Any:
        """Build NemotronVoiceChat from the config and stream its weights in (blocking)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from nemo.collections.speechlm2.models import NemotronVoiceChat

        model = NemotronVoiceChat(copy.deepcopy(self.config))
        self._add_function_head(model)
        model.init_from_safetensors_ckpt(str(self.directory))
        model.to(torch.device(device))
        model.eval()
        # the silence frame is the codec's code of zeros: computed with the loaded weights
        model.tts_model.codec_silence_tokens = model.tts_model.get_codec_silence_frame()
        return model


def _function_head_shape(path: Path) -> tuple[tuple[int, ...], bool] | None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        keys = set(f.keys())
        weight = f"{FUNCTION_HEAD}.weight"
        if weight not in keys:
            return None
        return tuple(f.get_slice(weight).get_shape()), f"{FUNCTION_HEAD}.bias" in keys


def _local(root: Path, name: Any, key: str) -> str:
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{root / CONFIG_FILE}: {key} is missing")
    path = Path(name)
    candidates = [path] if path.is_absolute() else [root / name, root / path.name]
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return str(candidate)
    raise CheckpointError(
        f"{key} is {name!r}: not found as a local directory with a config.json "
        f"(looked for {', '.join(str(c) for c in candidates)}); put the LLM's config and "
        "tokenizer files there (nothing is downloaded)"
    )


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "CheckpointError", "NemotronCheckpoint"]
