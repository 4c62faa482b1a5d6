"""kyutai's `moshi.server` (0.2.13, from .venv-moshi) on the CPU and the tiny checkpoint: the
reference that tests/plugins/moshi/test_reference_server.py compares our `/api/chat` with.

Run as a script, it is `python -m moshi.server` with its own command line and code, and one
change: `torch.cuda.synchronize` is a no-op, because `ServerState.warmup` ends with it and
it raises on a CPU-only torch (it only waits for CUDA work, of which there is none here).
It needs aiohttp (moshi's own requirement, `>=3.10.5,<3.12`), which a venv that installs
`moshi` with `--no-deps` must add.

The checkpoint is not changed either; `reference_checkpoint` writes the config that
moshi's loader reads for it and returns the command-line arguments that point there:

- our tiny checkpoint keeps its small Mimi's settings under a `"mimi"` key of config.json
  (plugins/moshi/checkpoint.py), which `CheckpointInfo.from_hf_repo` would pass to the LM as
  a keyword and then build a full-size Mimi. The reference's config is the same LM config
  without that key, with upstream's `mimi_config_name` naming a JSON file of the whole Mimi
  config (moshi's defaults with the same overrides deep-merged, as our loader builds it);
- `lm_gen_config` (an upstream config.json key, `LMGen`'s kwargs) carries the sampling
  settings: moshi.server has no command-line option for them;
- the files go in as `--moshi-weight`, `--mimi-weight`, `--tokenizer` and `--config-path`
  (local paths: nothing is downloaded), with `--static none` (no web UI to fetch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def reference_checkpoint(
    tiny_dir: Path, out_dir: Path, moshi_weight: Path | None = None, **lm_gen_config: Any
) -> list[str]:
    """Write moshi's config for the checkpoint in `tiny_dir` into `out_dir` and return
    moshi.server's arguments for it (`moshi_weight`: other LM weights of the same shape)."""
    from moshi.models import loaders

    from plugins.moshi.checkpoint import MIMI_OVERRIDES_KEY, deep_merge

    config = json.loads((tiny_dir / "config.json").read_text())
    mimi = deep_merge(loaders._mimi_config, config.pop(MIMI_OVERRIDES_KEY, {}))
    out_dir.mkdir(parents=True, exist_ok=True)
    mimi_path = out_dir / "mimi_config.json"
    mimi_path.write_text(json.dumps(mimi, indent=1))
    # "file://": moshi's hf_get reads a local file, never the hub, for this name
    config["mimi_config_name"] = f"file://{mimi_path.resolve()}"
    config["lm_gen_config"] = lm_gen_config
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps(config, indent=1))
    return [
        "--moshi-weight",
        str(moshi_weight or tiny_dir / loaders.MOSHI_NAME),
        "--mimi-weight",
        str(tiny_dir / loaders.MIMI_NAME),
        "--tokenizer",
        str(tiny_dir / loaders.TEXT_TOKENIZER_NAME),
        "--config-path",
        str(config_path),
        "--device",
        "cpu",
        "--static",
        "none",
    ]


def main() -> None:
    import torch

    # the one change (see the module doc): warmup's CUDA wait, on a machine without CUDA
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # moshi.server parses sys.argv and serves at import (its last line runs main())
    import moshi.server  # noqa: F401


if __name__ == "__main__":
    main()
