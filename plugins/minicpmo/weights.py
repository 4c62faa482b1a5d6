"""Reading a MiniCPM-o 4.5 checkpoint's weights into our modules.

The published checkpoint is one state dict in safetensors (sharded, with
`model.safetensors.index.json`, or one `model.safetensors`), its parameters named by
part: `llm.`, `apm.` (audio encoder), `audio_projection_layer.`, `vpm.` (vision
encoder), `resampler.`, `tts.`. Each of our parts is a module whose own parameter names are
the checkpoint's with the part's prefix taken off, so loading is a strict
`load_state_dict` per part: a missing or unexpected name is an error that says which, never
a silently random weight. The modules are built on the meta device and take the loaded
tensors as they are (`assign=True`), so the 8B model is never allocated twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from plugins.minicpmo.config import ModelDirError


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelDirError(
        f"{model_dir} has no model.safetensors (or model.safetensors.index.json): "
        "point --model-dir at a MiniCPM-o-4_5 download"
    )


def read_parts(
    model_dir: Path,
    prefixes: Iterable[str],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    skip: Mapping[str, Iterable[str]] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's tensors for each part prefix (e.g. "llm."), names relative to the
    prefix, cast to `dtype` on `device`; names under `skip[prefix]` (relative prefixes of
    parameters the duplex loop never uses) are left on disk."""
    prefixes = tuple(prefixes)
    skip = {prefix: tuple(names) for prefix, names in (skip or {}).items()}
    parts: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in prefixes}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                prefix = next((p for p in prefixes if name.startswith(p)), None)
                if prefix is None:
                    continue
                relative = name[len(prefix) :]
                if relative.startswith(skip.get(prefix, ())):
                    continue
                parts[prefix][relative] = handle.get_tensor(name).to(device=device, dtype=dtype)
    return parts


def load_part(module: nn.Module, tensors: dict[str, torch.Tensor], part: str) -> None:
    """Strict load of one part; the error names what is missing or unexpected."""
    state = module.state_dict()
    expected = set(state.keys())
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise ModelDirError(
            f"the checkpoint's {part!r} weights do not fit the model its config describes: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in tensors.items():
        wanted = state[name].shape
        if tensor.shape != wanted:
            raise ModelDirError(
                f"{part}{name} has shape {tuple(tensor.shape)}; the config says {tuple(wanted)}"
            )
    module.load_state_dict(tensors, strict=True, assign=True)


__all__ = ["checkpoint_files", "load_part", "read_parts"]
