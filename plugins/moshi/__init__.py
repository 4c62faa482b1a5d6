"""`moshi`: the Moshi family (kyutai's Moshi, NVIDIA's PersonaPlex preset) on kyutai's `moshi`
package: Mimi + the LM + `LMGen` in batched streaming, one row per session, stepped per 80 ms
frame by the worker's tick-batched stage.

Needs torch and `moshi`, which live in their own venv (`make .venv-moshi/.installed`): the
main venv has neither, and importing this package there fails here, with that advice, rather
than deep inside the worker.
"""

try:
    import moshi  # noqa: F401
    import torch  # noqa: F401
except ImportError as missing:  # pragma: no cover - the main venv
    raise ImportError(
        f"plugins.moshi needs torch and kyutai's moshi package ({missing}); they are "
        "installed in .venv-moshi (`make .venv-moshi/.installed`, or `pip install "
        "'duplex-serve[moshi]'` on a GPU image)"
    ) from missing

from plugins.moshi.checkpoint import CheckpointError, MoshiCheckpoint
from plugins.moshi.frame_model import MoshiFrameModel, SamplingSettings
from plugins.moshi.plugin import MoshiPlugin

__all__ = [
    "CheckpointError",
    "MoshiCheckpoint",
    "MoshiFrameModel",
    "MoshiPlugin",
    "SamplingSettings",
]
