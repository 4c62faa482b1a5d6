"""`MoshiPlugin`: the Moshi family as a frame-clocked plugin (`duplex worker --plugin moshi`).

Worker options (strings, from `--model-dir` / `--plugin-option KEY=VALUE`):

- `model_dir` (required): a local checkpoint directory (plugins/moshi/checkpoint.py); checked
  when the worker starts, never downloaded;
- `preset`: `moshi` or `personaplex` (default: what the checkpoint says, see personaplex.py);
- `device`: `cpu`, `cuda` or `cuda:N` (default: cuda when torch sees a GPU);
- `temperature`, `temperature_text` (0: greedy), `top_k`, `top_k_text`: `LMGen`'s sampling
  (default: the checkpoint's `lm_gen_config`, else moshi's 0.8/0.7/250/25);
- `threads`: torch CPU threads (default: cores - 1, at most 8);
- `interrupt_frames`: frames a barge-in keeps the model silent before it decides again
  (default 12, about 1 s; frame_model.py);
- `replay_chunk_frames`: the most frames of a restored session's history (or of a `.pt`
  voice's prefix) one `replay_work` call may replay (default 64). The worker's stage asks
  for as many as fit a tick's spare time, at most this, so a restore spreads over as many
  ticks as it needs; the side replay's key/value rings are the context plus this - 1;
- `voice_prompt_dir` (personaplex): where the voice prompt files are.

The model decides when it speaks: `auto_response: false` is refused (FrameClockedPlugin), and
no chat completions, text turns or truncation are offered. A session's `instructions` and
`voice` matter only to the PersonaPlex preset (its persona and voice prompt); Moshi has
neither, and ignores them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from plugins.moshi.checkpoint import MoshiCheckpoint
from plugins.moshi.frame_model import (
    INTERRUPT_FRAMES,
    REPLAY_CHUNK_FRAMES,
    MoshiFrameModel,
    SamplingSettings,
    sampling_from_config,
)
from plugins.moshi.personaplex import PersonaPlexPreset, checkpoint_preset
from shared.contracts import DuplexSessionConfig
from shared.contracts.frame_model import FrameClockedPlugin, FrameModel

PRESETS = ("moshi", "personaplex")


def _number(options: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"moshi option {key} must be a {kind.__name__}, got {raw!r}") from None
    if value != value or value < 0:  # NaN or negative
        raise ValueError(f"moshi option {key} must be 0 or more, got {raw!r}")
    return value


def read_sampling(options: Mapping[str, Any], checkpoint: MoshiCheckpoint) -> SamplingSettings:
    base = sampling_from_config(checkpoint.info.lm_gen_config)
    return SamplingSettings(
        temperature=_number(options, "temperature", float, base.temperature),
        temperature_text=_number(options, "temperature_text", float, base.temperature_text),
        top_k=_number(options, "top_k", int, base.top_k),
        top_k_text=_number(options, "top_k_text", int, base.top_k_text),
    )


def read_device(options: Mapping[str, Any]) -> str:
    device = str(options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device != "cpu" and not (device == "cuda" or device.startswith("cuda:")):
        raise ValueError(f"moshi option device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"moshi option device is {device!r} but torch sees no CUDA device")
    return device


class MoshiPlugin(FrameClockedPlugin):
    plugin_id = "moshi"
    input_sample_rate_hz = 24_000
    output_sample_rate_hz = 24_000

    def __init__(
        self,
        checkpoint: MoshiCheckpoint,
        preset: str = "moshi",
        device: str = "cpu",
        sampling: SamplingSettings | None = None,
        threads: int | None = None,
        voice_prompt_dir: Path | None = None,
        interrupt_frames: int = INTERRUPT_FRAMES,
        replay_chunk_frames: int = REPLAY_CHUNK_FRAMES,
    ) -> None:
        if preset not in PRESETS:
            raise ValueError(f"moshi option preset must be one of {PRESETS}, got {preset!r}")
        self.checkpoint = checkpoint
        self.preset = preset
        self.device = device
        self.sampling = sampling or sampling_from_config(checkpoint.info.lm_gen_config)
        self.threads = threads
        if replay_chunk_frames < 1:
            raise ValueError("moshi option replay_chunk_frames must be at least 1")
        self.interrupt_frames = interrupt_frames
        self.replay_chunk_frames = replay_chunk_frames
        self.personaplex = (
            PersonaPlexPreset(checkpoint, voice_prompt_dir) if preset == "personaplex" else None
        )

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MoshiPlugin:
        model_dir = options.get("model_dir")
        if not model_dir:
            raise ValueError("the moshi plugin needs a checkpoint directory: --model-dir DIR")
        checkpoint = MoshiCheckpoint.open(model_dir)
        preset = str(options.get("preset") or checkpoint_preset(checkpoint))
        voice_prompt_dir = options.get("voice_prompt_dir")
        threads = _number(options, "threads", int, None)
        return cls(
            checkpoint,
            preset=preset,
            device=read_device(options),
            sampling=read_sampling(options, checkpoint),
            threads=threads or None,
            voice_prompt_dir=Path(voice_prompt_dir) if voice_prompt_dir else None,
            interrupt_frames=_number(options, "interrupt_frames", int, INTERRUPT_FRAMES),
            replay_chunk_frames=_number(options, "replay_chunk_frames", int, REPLAY_CHUNK_FRAMES),
        )

    def frame_model(self, max_sessions: int) -> FrameModel:
        model = MoshiFrameModel.load(
            self.checkpoint,
            max_sessions,
            self.device,
            self.sampling,
            self.threads,
            interrupt_frames=self.interrupt_frames,
            replay_chunk_frames=self.replay_chunk_frames,
        )
        if self.personaplex is not None:
            self.personaplex.attach(model)
        return model

    async def prepare_runtime_config(self, config: DuplexSessionConfig) -> dict[str, Any]:
        """What `open_slot` gets (JSON-able: it is checkpointed with the session)."""
        if self.personaplex is None:
            return {}
        return self.personaplex.runtime_config(config.instructions, config.voice)

    def runtime_config_for_update(
        self, runtime_config: Mapping[str, Any], config: DuplexSessionConfig
    ) -> dict[str, Any]:
        """A persona or voice changed by `session.update` does not change a running
        conversation: its prompt is in the model's memory, which moves with the session
        and is rebuilt from the options it opened with (a `.pt` voice's embeddings are
        replayed from them), so those options stay as they were."""
        return dict(runtime_config)


__all__ = ["PRESETS", "MoshiPlugin", "read_device", "read_sampling"]
