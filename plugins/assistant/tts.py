"""Speech synthesis with espeak-ng, from the library and voice data that the
`espeakng-loader` wheel ships (no system package, no download).

libespeak-ng keeps global state: one `EspeakSynthesizer` per process, every call under
its lock, on a worker thread (a sentence takes milliseconds).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np

AUDIO_OUTPUT_SYNCHRONOUS = 2
ESPEAK_CHARS_UTF8 = 1
POS_CHARACTER = 1
ESPEAK_RATE = 1  # espeak_PARAMETER: words per minute

SYNTH_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class EspeakSynthesizer:
    """Text -> mono float32 PCM at `sample_rate_hz` (22 050 Hz for espeak-ng's voices)."""

    _instance: EspeakSynthesizer | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def shared(cls) -> EspeakSynthesizer:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self, voice: str = "en-us", words_per_minute: int = 175) -> None:
        import espeakng_loader

        self._lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self._lib.espeak_Initialize.restype = ctypes.c_int
        self._lib.espeak_Initialize.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        self._lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        data_parent = str(Path(espeakng_loader.get_data_path()).parent).encode()
        rate = self._lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data_parent, 0)
        if rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed ({rate})")
        self.sample_rate_hz = rate
        if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise RuntimeError(f"espeak-ng has no voice {voice!r}")
        self._lib.espeak_SetParameter(ESPEAK_RATE, words_per_minute, 0)
        self._chunks: list[np.ndarray] = []
        self._callback = SYNTH_CALLBACK(self._collect)  # kept: ctypes must not free it
        self._lib.espeak_SetSynthCallback(self._callback)
        self._lock = threading.Lock()

    def _collect(self, wav, count: int, events) -> int:
        if count > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0  # go on

    def synthesize(self, text: str) -> np.ndarray:
        """The whole utterance of `text`; empty for text with nothing to say."""
        if not text.strip():
            return np.zeros(0, np.float32)
        data = text.encode("utf-8") + b"\0"
        with self._lock:
            self._chunks = []
            error = self._lib.espeak_Synth(
                data, len(data), 0, POS_CHARACTER, 0, ESPEAK_CHARS_UTF8, None, None
            )
            if error != 0:
                raise RuntimeError(f"espeak_Synth failed ({error})")
            self._lib.espeak_Synchronize()
            chunks, self._chunks = self._chunks, []
        if not chunks:
            return np.zeros(0, np.float32)
        return (np.concatenate(chunks).astype(np.float32) / 32768.0).astype(np.float32)
