"""`minicpmo`: OpenBMB's MiniCPM-o 4.5 served in duplex mode, audio (and camera frames) in
1 s units, speech out through its speech-token model and vocoder, as a frame-clocked plugin
(`duplex worker --plugin minicpmo --model-dir DIR`).

Our own implementation of the model on transformers' building blocks; it loads the
published checkpoint layout from a local directory. The plugin (options, session policy)
imports without torch or transformers; the model (`plugins.minicpmo.frame_model`) needs
them and is imported only when a worker loads it.
"""

from plugins.minicpmo.plugin import MiniCPMOPlugin

__all__ = ["MiniCPMOPlugin"]
