"""Model plugins by name (`duplex worker --plugin NAME`), and the stage of a frame-clocked
one (`build_frame_stage`)."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Mapping
from typing import Any

from services.worker.stages.tick_batched import TickBatchedStagePort
from services.worker.stages.tick_metrics import TickMetrics
from shared.contracts import DuplexModelPlugin, FrameClockedPlugin

#: name -> "module:Class". A full "module:Class" also works as a name.
KNOWN_PLUGINS = {
    "echo": "plugins.echo:EchoPlugin",
    "assistant": "plugins.assistant:AssistantPlugin",
    # Moshi and PersonaPlex (frame-clocked); needs torch and `moshi`: the .venv-moshi venv
    "moshi": "plugins.moshi:MoshiPlugin",
    # Nemotron VoiceChat (frame-clocked, tool calls); its model needs torch and NeMo
    "nemotron": "plugins.nemotron:NemotronPlugin",
    # MiniCPM-o 4.5 (frame-clocked, 1 s units, camera frames); its model needs torch and
    # transformers: the .venv-minicpmo venv
    "minicpmo": "plugins.minicpmo:MiniCPMOPlugin",
}


def load_plugin(
    name: str, options: Mapping[str, str] | None = None, max_sessions: int = 64
) -> DuplexModelPlugin:
    """The plugin `name`, built from `options`; an `llm_model` option becomes a vLLM text
    stage (one engine for this worker process) handed to the plugin as `text_stage`."""
    target = KNOWN_PLUGINS.get(name, name)
    if ":" not in target:
        raise ValueError(f"unknown plugin {name!r}; known: {', '.join(sorted(KNOWN_PLUGINS))}")
    module_name, class_name = target.split(":", 1)
    plugin_class = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(plugin_class, type) and issubclass(plugin_class, DuplexModelPlugin)):
        raise TypeError(f"{target} is not a DuplexModelPlugin")
    built: dict[str, Any] = dict(options or {})
    if model := built.pop("llm_model", None):
        from services.worker.stages.vllm import VllmStagePort

        built["text_stage"] = VllmStagePort.for_model(model, max_num_seqs=max_sessions)
    return plugin_class.from_options(built)


async def build_frame_stage(
    plugin: FrameClockedPlugin, max_sessions: int, metrics: TickMetrics | None = None
) -> TickBatchedStagePort:
    """The worker's one tick-batched stage of a frame-clocked plugin. The model is built
    (its weights loaded) on a thread of its own, so the event loop goes on meanwhile."""
    model = await asyncio.to_thread(plugin.frame_model, max_sessions)
    if model.slots < 1:
        raise ValueError(f"{plugin.plugin_id}: its model has no slot ({model.slots})")
    return TickBatchedStagePort.for_plugin(plugin, model, metrics)
