"""Model plugins by name (`duplex worker --plugin NAME`)."""

from __future__ import annotations

import importlib

from shared.contracts import DuplexModelPlugin

#: name -> "module:Class". A full "module:Class" also works as a name.
KNOWN_PLUGINS = {
    "echo": "plugins.echo:EchoPlugin",
}


def load_plugin(name: str) -> DuplexModelPlugin:
    target = KNOWN_PLUGINS.get(name, name)
    if ":" not in target:
        raise ValueError(f"unknown plugin {name!r}; known: {', '.join(sorted(KNOWN_PLUGINS))}")
    module_name, class_name = target.split(":", 1)
    plugin_class = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(plugin_class, type) and issubclass(plugin_class, DuplexModelPlugin)):
        raise TypeError(f"{target} is not a DuplexModelPlugin")
    return plugin_class()
