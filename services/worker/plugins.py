"""Model plugins by name (`duplex worker --plugin NAME`)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from shared.contracts import DuplexModelPlugin

#: name -> "module:Class". A full "module:Class" also works as a name.
KNOWN_PLUGINS = {
    "echo": "plugins.echo:EchoPlugin",
    "assistant": "plugins.assistant:AssistantPlugin",
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
