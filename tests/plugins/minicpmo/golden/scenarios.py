"""The inputs of the MiniCPM-o golden runs: the same numbers for the reference (make_golden.py, in
its own venv) and for our implementation's parity tests.

numpy and Pillow only. Audio is 16 kHz mono float32 that is exactly pcm16 (int16 / 32768), one
16000-sample array per 1 s unit, as a client's audio reaches the model; every unit's sound is
drawn from `numpy.random.default_rng` (PCG64: the same bits on every machine). A session may open
with a reference voice (`Scenario.ref_audio`, any length, the same format), which the reference
feeds into the system prompt between the prefix and suffix tokens. Camera frames are
JPEG bytes, as clients send them: seeded pictures encoded by Pillow at a fixed quality; each side
decodes the same bytes with `decode_frame`. The golden files record a digest of every unit's
input (`unit_digest`) and of the reference voice (`audio_digest`), so a drifting encoder shows as
an input mismatch, not as a model bug.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image

SAMPLE_RATE = 16000
UNIT_SAMPLES = 16000  # one duplex unit: 1 s
JPEG_QUALITY = 85

# The session prompt as the demo server frames it, with or without a reference voice (its
# duplex prepare() always puts <|audio_start|>/<|audio_end|> around the place of the reference
# audio; vLLM-Omni adds them only when there is one, which gives the same ids when there is):
# prefix tokens, the reference audio's embeddings if any, suffix tokens.
PROMPT_PREFIX = "<|im_start|>system\n{prompt}\n<|audio_start|>"
PROMPT_SUFFIX = "<|audio_end|><|im_end|>"


@dataclass(frozen=True)
class Unit:
    audio: np.ndarray  # float32 [UNIT_SAMPLES], values k / 32768
    frames: tuple[bytes, ...] = ()  # JPEG images seen during this unit, in order


@dataclass(frozen=True)
class Scenario:
    name: str
    prompt: str
    units: tuple[Unit, ...]
    # the session's reference voice: float32 16 kHz, values k / 32768, any length (None: none)
    ref_audio: np.ndarray | None = None

    @property
    def prefix(self) -> str:
        return PROMPT_PREFIX.format(prompt=self.prompt)

    @property
    def suffix(self) -> str:
        return PROMPT_SUFFIX


def decode_frame(jpeg: bytes) -> Image.Image:
    """A camera frame as the model sees it: the JPEG decoded by Pillow, RGB."""
    with Image.open(io.BytesIO(jpeg)) as image:
        return image.convert("RGB")


def _pcm16_bytes(audio: np.ndarray) -> bytes:
    return np.round(audio * 32768).astype("<i2").tobytes()


def audio_digest(audio: np.ndarray) -> str:
    """sha256 over pcm16 samples (the reference voice's digest)."""
    return hashlib.sha256(_pcm16_bytes(audio)).hexdigest()


def unit_digest(unit: Unit) -> str:
    """sha256 over the unit's pcm16 samples and its JPEG bytes."""
    digest = hashlib.sha256(_pcm16_bytes(unit.audio))
    for frame in unit.frames:
        digest.update(len(frame).to_bytes(4, "little"))
        digest.update(frame)
    return digest.hexdigest()


# --- sounds (each returns float64 in about [-1, 1], UNIT_SAMPLES long) ---------------------------

_T = np.arange(UNIT_SAMPLES) / SAMPLE_RATE


def _pcm16(signal: np.ndarray) -> np.ndarray:
    clipped = np.clip(signal, -1.0, 32767 / 32768)
    return (np.round(clipped * 32768).astype(np.int16).astype(np.float32) / 32768).astype(
        np.float32
    )


def _silence(rng: np.random.Generator) -> np.ndarray:
    # a quiet room, not digital zero (the first unit's left padding is the only zero run)
    return rng.standard_normal(UNIT_SAMPLES) * 10 ** rng.uniform(-4.0, -3.3)


def _noise(rng: np.random.Generator) -> np.ndarray:
    white = rng.standard_normal(UNIT_SAMPLES)
    kernel = np.ones(int(rng.integers(1, 8)))  # a little low-pass, different each time
    return np.convolve(white, kernel / kernel.size, mode="same") * rng.uniform(0.05, 0.3)


def _tone(rng: np.random.Generator) -> np.ndarray:
    f = rng.uniform(180.0, 1200.0)
    return rng.uniform(0.1, 0.5) * np.sin(2 * np.pi * f * _T + rng.uniform(0, 2 * np.pi))


def _speech(rng: np.random.Generator, samples: int = UNIT_SAMPLES) -> np.ndarray:
    """Voiced syllables: a gliding f0 with harmonics weighted by two formants, gated at a
    syllable rate, over a little breath noise. `samples` long (a unit unless told)."""
    t = np.arange(samples) / SAMPLE_RATE
    f0 = rng.uniform(90.0, 240.0) * (1 + 0.08 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * t))
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    formants = rng.uniform([300.0, 900.0], [900.0, 2500.0])
    voiced = np.zeros(samples)
    for k in range(1, 30):
        weight = sum(np.exp(-((((k * f0.mean()) - f) / 200.0) ** 2)) for f in formants) + 0.05
        voiced += weight / k * np.sin(k * phase)
    rate = rng.uniform(2.5, 6.0)
    gate = np.clip(np.sin(2 * np.pi * rate * t + rng.uniform(0, 2 * np.pi)), 0, None) ** 0.7
    breath = 0.02 * rng.standard_normal(samples)
    level = rng.uniform(0.15, 0.6)
    return level * (voiced / np.abs(voiced).max() * gate + breath)


def _speech_then_silence(rng: np.random.Generator) -> np.ndarray:
    """Speech that stops within the unit (the end of a user's sentence)."""
    cut = int(rng.integers(4000, 12000))
    out = _silence(rng)
    out[:cut] = _speech(rng)[:cut]
    return out


def _silence_then_speech(rng: np.random.Generator) -> np.ndarray:
    cut = int(rng.integers(4000, 12000))
    out = _silence(rng)
    out[cut:] = _speech(rng)[cut:]
    return out


def _reference_voice(rng: np.random.Generator, samples: int) -> np.ndarray:
    """A speaker's sample as a client records one: voiced from the first sample to the last
    (the STFT's reflect padding at the start and the zero padding at the end both see speech),
    with a noise-gated pause of digital silence and then a quiet room in the middle (the log-mel
    floor of max - 8 (log10) cuts the silence, which would sit at -10 under the streaming path's
    fixed floor)."""
    out = _speech(rng, samples)
    gate, resume = int(rng.integers(20000, 24000)), int(rng.integers(30000, 32000))
    pause = gate + 2400  # 150 ms of zeros
    out[gate:pause] = 0.0
    out[pause:resume] = _silence(rng)[: resume - pause]
    return out


SOUNDS: dict[str, Callable[[np.random.Generator], np.ndarray]] = {
    "silence": _silence,
    "noise": _noise,
    "tone": _tone,
    "speech": _speech,
    "speech_end": _speech_then_silence,
    "speech_start": _silence_then_speech,
}


def _audio_units(seed: int, plan: list[str]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [_pcm16(SOUNDS[kind](rng)) for kind in plan]


# --- camera frames -----------------------------------------------------------------------------


def _picture(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A smooth seeded picture (gradients, a few discs and bars, mild grain) as JPEG bytes."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    image = np.empty((height, width, 3))
    for c in range(3):
        a, b, c0 = rng.uniform(-1, 1, size=3)
        image[..., c] = 128 + 60 * (a * x / width + b * y / height) + 40 * c0
    for _ in range(int(rng.integers(2, 6))):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        r = rng.uniform(0.05, 0.3) * min(width, height)
        inside = (x - cx) ** 2 + (y - cy) ** 2 < r * r
        image[inside] = rng.uniform(0, 255, size=3)
    for _ in range(int(rng.integers(1, 4))):
        y0 = int(rng.integers(0, height))
        image[y0 : y0 + max(1, height // 20)] = rng.uniform(0, 255, size=3)
    image += rng.normal(0, 4, size=image.shape)
    pixels = np.clip(np.round(image), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(
        buffer,
        format="JPEG",
        quality=JPEG_QUALITY,
        optimize=False,
        progressive=False,
        subsampling=2,
    )
    return buffer.getvalue()


# --- the scenarios -----------------------------------------------------------------------------

# 36 units: crosses the mel floor switch (buffer >= 5 s from unit 5), the mel buffer's first
# slide (30 s, unit 29) and the Whisper KV reset (unit 29: 29 x 50 positions + 52 >= 1500).
AUDIO_LONG_PLAN = [
    "silence",
    "silence",
    "speech_start",
    "speech",
    "speech",
    "speech_end",
    "silence",
    "silence",
    "silence",
    "tone",
    "speech",
    "speech",
    "speech_end",
    "silence",
    "silence",
    "noise",
    "silence",
    "speech_start",
    "speech",
    "speech",
    "speech",
    "speech_end",
    "silence",
    "silence",
    "silence",
    "silence",
    "tone",
    "speech_start",
    "speech",
    "speech",
    "speech_end",
    "silence",
    "noise",
    "silence",
    "speech",
    "silence",
]

# A different voice and order, for a session that joins a batch later.
AUDIO_SHORT_PLAN = [
    "speech",
    "speech_end",
    "silence",
    "silence",
    "speech_start",
    "speech",
    "speech_end",
    "silence",
    "noise",
    "silence",
]

# 10 units of camera and audio: frames of several sizes (landscape, small, odd and tiny,
# portrait) on some units, none on others.
CAMERA_AUDIO_PLAN = [
    "silence",
    "speech",
    "speech_end",
    "silence",
    "speech_start",
    "speech",
    "speech_end",
    "silence",
    "silence",
    "tone",
]
CAMERA_FRAME_SIZES: dict[int, tuple[int, int]] = {
    0: (640, 480),
    1: (640, 480),
    3: (320, 240),
    4: (97, 61),
    6: (480, 640),
    7: (640, 480),
    9: (320, 240),
}

# A session that opens with a reference voice: the prompt of the demo's English duplex preset
# (the text before the voice), a 3.4 s voice (not whole seconds: the reference's 1 s chunk mask
# over the clip ends in a partial chunk), and 10 units of its own.
REF_VOICE_PROMPT = (
    "Replicate the tone and style from the input audio. Your task is to be a helpful assistant "
    "using this voice pattern. Please answer the user's questions seriously and in a high quality. "
    "Please chat with the user in a high naturalness style. You are in duplex mode, where you can "
    "listen and speak at the same time."
)
REF_VOICE_SAMPLES = 54400  # 3.4 s
REF_VOICE_PLAN = [
    "silence",
    "speech_start",
    "speech",
    "speech_end",
    "silence",
    "silence",
    "speech",
    "speech_end",
    "silence",
    "tone",
]


def audio_long() -> Scenario:
    units = _audio_units(101, AUDIO_LONG_PLAN)
    return Scenario(
        "audio_long", "Streaming Omni Conversation.", tuple(Unit(audio) for audio in units)
    )


def audio_short() -> Scenario:
    units = _audio_units(202, AUDIO_SHORT_PLAN)
    return Scenario(
        "audio_short", "You are a helpful assistant.", tuple(Unit(audio) for audio in units)
    )


def camera() -> Scenario:
    units = _audio_units(303, CAMERA_AUDIO_PLAN)
    rng = np.random.default_rng(304)
    frames = {k: _picture(rng, w, h) for k, (w, h) in sorted(CAMERA_FRAME_SIZES.items())}
    return Scenario(
        "camera",
        "Describe what you see.",
        tuple(Unit(audio, (frames[k],) if k in frames else ()) for k, audio in enumerate(units)),
    )


def ref_voice() -> Scenario:
    voice = _pcm16(_reference_voice(np.random.default_rng(424), REF_VOICE_SAMPLES))
    units = _audio_units(405, REF_VOICE_PLAN)
    return Scenario(
        "ref_voice", REF_VOICE_PROMPT, tuple(Unit(audio) for audio in units), ref_audio=voice
    )


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "audio_long": audio_long,
    "camera": camera,
    "audio_short": audio_short,
    "ref_voice": ref_voice,
}
