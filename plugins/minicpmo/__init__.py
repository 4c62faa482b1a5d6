"""MiniCPM-o 4.5 (OpenBMB), served in duplex mode: audio (and camera frames) in 1 s units,
speech out through its speech-token model and vocoder. Our own implementation of the model
on transformers' building blocks; it loads the published checkpoint layout from a local
directory (`--model-dir`)."""
