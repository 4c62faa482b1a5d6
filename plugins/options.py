"""Reading a model plugin's worker options (`--model-dir`, `--plugin-option KEY=VALUE`): the
ones every model that runs on torch takes alike, with errors that name the plugin and the
option. Options arrive as strings; "" and absent are the same."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def option_count(options: Mapping[str, Any], key: str, minimum: int, plugin: str) -> int | None:
    """An integer option of at least `minimum` (None when absent or "")."""
    raw = options.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{plugin} option {key} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{plugin} option {key} must be {minimum} or more, got {raw!r}")
    return value


def option_choice(
    options: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str, plugin: str
) -> str:
    """One of `allowed` (`default` when absent or "")."""
    value = str(options.get(key) or default)
    if value not in allowed:
        raise ValueError(
            f"{plugin} option {key} must be one of {', '.join(allowed)}, got {value!r}"
        )
    return value


def cuda_available() -> bool:
    """Whether torch sees a GPU (False where torch is not installed: the main venv)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def read_device(options: Mapping[str, Any], plugin: str) -> str:
    """`device`: cpu, cuda or cuda:N (default: cuda when torch sees a GPU, else cpu)."""
    device = str(options.get("device") or ("cuda" if cuda_available() else "cpu"))
    index = device.removeprefix("cuda:")
    if device not in ("cpu", "cuda") and not (device.startswith("cuda:") and index.isdigit()):
        raise ValueError(f"{plugin} option device must be cpu, cuda or cuda:N, got {device!r}")
    if device != "cpu" and not cuda_available():
        raise ValueError(f"{plugin} option device is {device!r} but torch sees no CUDA device")
    return device


def read_model_dir(options: Mapping[str, Any], plugin: str) -> Path:
    """`model_dir`: an existing local directory (a checkpoint is never downloaded)."""
    raw = options.get("model_dir")
    if not raw:
        raise ValueError(f"the {plugin} plugin needs a checkpoint directory: --model-dir DIR")
    path = Path(str(raw)).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"{plugin} option model_dir {str(raw)!r} is not a directory (a checkpoint is read "
            "from a local directory, never downloaded)"
        )
    return path


__all__ = ["cuda_available", "option_choice", "option_count", "read_device", "read_model_dir"]
