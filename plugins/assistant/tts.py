"""Speech synthesis with espeak-ng, from the library and voice data that the
`espeakng-loader` wheel ships (no system package, no download).

libespeak-ng keeps global state: one `EspeakSynthesizer` per process, every call under
one process-wide lock, on a worker thread (a sentence takes milliseconds).

The same text is said with the same samples, whatever was said before it. libespeak-ng's
wave generator carries state from one utterance to the next that no call resets, not even
espeak_Terminate and espeak_Initialize: the position in its pitch-flutter table (a static
that advances every 64 samples), its count of pitch cycles (roughness lowers every second or
third one), its gain control. "the quick brown fox jumps over the lazy dog" said 60 times
between other sentences came out 57 different ways, 57 640 to 57 667 samples long (57 650
when said first); Whisper heard it as "... the lazy dog" or "... the lazy nard", and once as
"the quick round-fark stump over the lazy nard", depending on what the process had said
before. So each synthesis loads the library, sets it up and unloads it (dlclose of its last
reference, which drops every static): about 5 ms more a sentence, 8 ms instead of 3 for
"Hello! How can I help you?" (1.8 s of speech).

Unloading leaks nothing: espeak_Terminate frees what the library allocated except the array
that espeak_ListVoices returns (a static of the library, 8 bytes a voice, about 2 KB), which
is freed here once the library is gone (the same calls in C under valgrind: no block lost;
40 000 syntheses here: resident memory flat). Should something else in the process hold
libespeak-ng too, dlclose does not unload it: then the array is left alone, the state carries
over, and a warning says so.
"""

from __future__ import annotations

import _ctypes
import ctypes
import logging
import os
import threading
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

AUDIO_OUTPUT_SYNCHRONOUS = 2
ESPEAK_CHARS_UTF8 = 1
POS_CHARACTER = 1
ESPEAK_RATE = 1  # espeak_PARAMETER: words per minute

SYNTH_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)

# releases a library ctypes loaded (dlclose on POSIX, FreeLibrary on Windows)
_close_library = getattr(_ctypes, "dlclose", None) or _ctypes.FreeLibrary
# the C allocator libespeak-ng mallocs with
_libc_free = ctypes.CDLL(None).free if os.name == "posix" else None
if _libc_free is not None:
    _libc_free.argtypes = [ctypes.c_void_p]
    _libc_free.restype = None


class EspeakSynthesizer:
    """Text -> mono float32 PCM at `sample_rate_hz` (22 050 Hz for espeak-ng's voices)."""

    _instance: EspeakSynthesizer | None = None
    _instance_lock = threading.Lock()
    # the library's state is the process's: every load, synthesis and unload holds this
    _library_lock = threading.Lock()

    @classmethod
    def shared(cls) -> EspeakSynthesizer:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self, voice: str = "en-us", words_per_minute: int = 175) -> None:
        import espeakng_loader

        self._library_path = espeakng_loader.get_library_path()
        self._data_parent = str(Path(espeakng_loader.get_data_path()).parent).encode()
        self.voice = voice
        self.words_per_minute = words_per_minute
        self._chunks: list[np.ndarray] = []
        self._callback = SYNTH_CALLBACK(self._collect)  # kept: ctypes must not free it
        self._warned_still_loaded = False
        with self._library_lock:  # once now: a missing voice fails here, not at a reply
            lib, voices, self.sample_rate_hz = self._load()
            self._unload(lib, voices)

    def _load(self) -> tuple[ctypes.CDLL, int | None, int]:
        """The library, freshly loaded and set up; the array espeak_ListVoices returned;
        the sample rate."""
        lib = ctypes.CDLL(self._library_path)
        voices = None
        try:
            lib.espeak_Initialize.restype = ctypes.c_int
            lib.espeak_Initialize.argtypes = [
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_char_p,
                ctypes.c_int,
            ]
            lib.espeak_Synth.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_uint,
                ctypes.c_int,
                ctypes.c_uint,
                ctypes.c_uint,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ]
            lib.espeak_ListVoices.restype = ctypes.c_void_p
            lib.espeak_ListVoices.argtypes = [ctypes.c_void_p]
            rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, self._data_parent, 0)
            if rate <= 0:
                raise RuntimeError(f"espeak_Initialize failed ({rate})")
            # listed first, so that selecting the voice does not list them again: this is
            # the array the library keeps for the process's life and never frees
            voices = lib.espeak_ListVoices(None)
            if lib.espeak_SetVoiceByName(self.voice.encode()) != 0:
                raise RuntimeError(f"espeak-ng has no voice {self.voice!r}")
            lib.espeak_SetParameter(ESPEAK_RATE, self.words_per_minute, 0)
            lib.espeak_SetSynthCallback(self._callback)
        except BaseException:
            self._unload(lib, voices)
            raise
        return lib, voices, rate

    def _unload(self, lib: ctypes.CDLL, voices: int | None) -> None:
        """Terminate and unload: the next load starts from the library's initial state."""
        lib.espeak_Terminate()
        _close_library(lib._handle)
        if voices is None or _libc_free is None:
            return
        try:  # still mapped? (RTLD_NOLOAD: a handle only to a library already loaded)
            probe = ctypes.CDLL(self._library_path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        except OSError:  # gone with its statics: the array is nobody's now
            _libc_free(voices)
            return
        _close_library(probe._handle)
        if not self._warned_still_loaded:
            self._warned_still_loaded = True
            log.warning(
                "libespeak-ng stays loaded (another user in this process): synthesis "
                "depends on what was said before"
            )

    def _collect(self, wav, count: int, events) -> int:
        if count > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0  # go on

    def synthesize(self, text: str) -> np.ndarray:
        """The whole utterance of `text`, the same samples for the same text; empty for
        text with nothing to say."""
        if not text.strip():
            return np.zeros(0, np.float32)
        data = text.encode("utf-8") + b"\0"
        with self._library_lock:
            lib, voices, _ = self._load()
            try:
                self._chunks = []
                error = lib.espeak_Synth(
                    data, len(data), 0, POS_CHARACTER, 0, ESPEAK_CHARS_UTF8, None, None
                )
                if error != 0:
                    raise RuntimeError(f"espeak_Synth failed ({error})")
                lib.espeak_Synchronize()
                chunks, self._chunks = self._chunks, []
            finally:
                self._unload(lib, voices)
        if not chunks:
            return np.zeros(0, np.float32)
        return (np.concatenate(chunks).astype(np.float32) / 32768.0).astype(np.float32)
