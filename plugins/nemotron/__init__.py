"""`nemotron`: NVIDIA's Nemotron VoiceChat, a full-duplex speech model with tool calls, as a
frame-clocked plugin (`duplex worker --plugin nemotron --model-dir DIR`).

The plugin (options, session policy, the tool-call text format) imports without torch or
NeMo; the model (`plugins.nemotron.frame_model`) needs them and is imported only when a
worker loads it.
"""

from plugins.nemotron.plugin import NemotronPlugin

__all__ = ["NemotronPlugin"]
