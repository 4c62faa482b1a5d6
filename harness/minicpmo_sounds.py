"""What the end-to-end tests of MiniCPM-o say and show to its tiny random checkpoint
(plugins/minicpmo/builder.py), from real processes and other people's clients: sounds it
hears as a voice or as a quiet room, and camera frames. numpy and Pillow only (no torch):
the main venv writes them to files for the clients' own venvs.

The tiny model decides by a designed feature, the sound level of a unit's end (builder.py's
`DecisiveInit`): a broadband voice (harmonics under formants, gated at a syllable rate)
makes it speak (" there", then " and" and the end of its turn once the voice stops), a quiet
room (noise about 70 dB down) makes it listen. A pure tone is not a voice to it: its
energy sits in a few mel bins. `turns` repeats 2 s of voice and 2 s of quiet, which it
answers every time, wherever the 1 s units fall on the stream (checked at several offsets).
"""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
from PIL import Image

#: the model's own input rate
RATE = 16_000


def voiced(seconds: float, rate: int = RATE, seed: int = 0, level: float = 0.4) -> np.ndarray:
    """A voice-like sound: a gliding 140 Hz fundamental and 29 harmonics, gated at 4
    syllables a second, over a little breath noise; float32 in [-level, level]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140.0 * (1 + 0.08 * np.sin(2 * np.pi * 1.5 * t))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    harmonics = sum(np.sin(k * phase) / k for k in range(1, 30))
    gate = np.clip(np.sin(2 * np.pi * 4 * t), 0, None) ** 0.7
    sound = harmonics / np.abs(harmonics).max() * gate + 0.02 * rng.standard_normal(len(t))
    return (level * sound / np.abs(sound).max()).astype(np.float32)


def quiet(seconds: float, rate: int = RATE, seed: int = 1) -> np.ndarray:
    """A quiet room (not digital zero): white noise at an RMS of 3e-4."""
    rng = np.random.default_rng(seed)
    return (3e-4 * rng.standard_normal(int(seconds * rate))).astype(np.float32)


def turns(count: int, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """`count` times 2 s of voice then 2 s of quiet: a turn the model answers, each."""
    return np.concatenate(
        [
            part
            for k in range(count)
            for part in (voiced(2, rate, seed + k), quiet(2, rate, seed + 100 + k))
        ]
    )


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE) -> Path:
    """Mono pcm16 WAV."""
    pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())
    return path


def camera_frame(seed: int, width: int = 64, height: int = 48, fmt: str = "JPEG") -> bytes:
    """A small seeded picture (a gradient and a disc), encoded as JPEG or PNG: a frame
    the model's camera path decodes (its sides and aspect ratio within its bounds)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    image = np.empty((height, width, 3))
    for c in range(3):
        a, b = rng.uniform(-1, 1, size=2)
        image[..., c] = 128 + 100 * (a * x / width + b * y / height)
    cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), min(width, height) / 4
    image[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, size=3)
    pixels = np.clip(np.round(image), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format=fmt)
    return out.getvalue()


#: a file that starts as a JPEG and is broken after: the worker passes it (it looks at the
#: first bytes only), the model cannot decode it
BROKEN_JPEG = b"\xff\xd8\xff\xe0" + b"not the rest of a jpeg" * 8

__all__ = [
    "BROKEN_JPEG",
    "RATE",
    "camera_frame",
    "quiet",
    "turns",
    "voiced",
    "write_wav",
]
