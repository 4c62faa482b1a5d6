"""libopus's encoder, called through ctypes: the API pod's Opus encoder for Moshi's protocol.

Why not `sphn` (which the pod decodes with): its `OpusStreamWriter` has no complexity knob,
runs libopus at complexity 10 in its VoIP mode, and holds the GIL while it encodes. A
listening model's frame (low-level noise) then costs about 1 ms of the pod's CPU per 80 ms,
and a batched tick's frames, encoded back to back on the event loop, stall it for about
1 ms a session. Here the encoder is libopus itself in its `AUDIO` application at complexity
5: 0.15-0.3 ms a frame whatever the model says (docs/benchmarks.md, `surface_cpu`), and a
ctypes call releases the GIL, so the pod encodes on a thread of its own (`EncoderThread`
in services/api/ogg_opus.py) while its loop goes on.

The library is the system's (`libopus0` on Debian, `opus` in Homebrew): `load()` raises
`LibopusMissing` without it, and the pod then falls back to sphn's encoder (logged once).
`opus_encoder_ctl` is variadic; its integer arguments are passed as C ints, which is the
fixed-argument convention on the platforms we run (x86-64 and aarch64 Linux). A setting it
refuses is logged and the encoder keeps libopus's default: complexity only trades CPU for
quality, never what goes on the wire.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("duplex.api.libopus")

#: opus_defines.h
OPUS_OK = 0
OPUS_APPLICATION_AUDIO = 2049
OPUS_SET_COMPLEXITY_REQUEST = 4010
OPUS_GET_LOOKAHEAD_REQUEST = 4027
#: complexity 5 of 0-10: about a fifth of 10's CPU on speech and noise, at a small cost in
#: quality at the same bitrate (measured in docs/benchmarks.md)
COMPLEXITY = 5
#: libopus's recommended output bound for one packet
MAX_PACKET_BYTES = 4000
#: the names the library goes by: Linux's soname, then macOS's, then whatever the
#: platform's search finds
_NAMES = ("libopus.so.0", "libopus.0.dylib")


class LibopusMissing(RuntimeError):
    """No libopus on this machine (install Debian's `libopus0`)."""


class LibopusError(RuntimeError):
    """libopus refused a call (its error code and message)."""


@functools.cache
def load() -> ctypes.CDLL:
    """The system's libopus, with the signatures we call (cached: loaded once)."""
    names = [*_NAMES]
    if found := ctypes.util.find_library("opus"):
        names.append(found)
    lib = None
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        raise LibopusMissing("libopus is not installed (Debian: apt-get install libopus0)")
    lib.opus_get_version_string.restype = ctypes.c_char_p
    lib.opus_get_version_string.argtypes = []
    lib.opus_strerror.restype = ctypes.c_char_p
    lib.opus_strerror.argtypes = [ctypes.c_int]
    lib.opus_encoder_get_size.restype = ctypes.c_int
    lib.opus_encoder_get_size.argtypes = [ctypes.c_int]
    lib.opus_encoder_init.restype = ctypes.c_int
    lib.opus_encoder_init.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int, ctypes.c_int]
    lib.opus_encode.restype = ctypes.c_int32
    lib.opus_encode.argtypes = [
        ctypes.c_void_p,  # the encoder's state
        ctypes.c_char_p,  # opus_int16 pcm[frame_size]: pcm16 bytes, passed without a copy
        ctypes.c_int,  # frame_size, samples
        ctypes.c_void_p,  # the packet out
        ctypes.c_int32,  # its room
    ]
    lib.opus_encoder_ctl.restype = ctypes.c_int
    return lib


def version() -> str:
    return load().opus_get_version_string().decode()


def _strerror(lib: ctypes.CDLL, code: int) -> str:
    return f"{lib.opus_strerror(code).decode()} ({code})"


class Encoder:
    """One mono libopus encoder at `sample_rate_hz` (8, 12, 16, 24 or 48 kHz).

    Not thread-safe: one thread at a time calls `encode` (the pod's `EncoderThread` is one
    thread). Its state is a buffer this object owns, so it is freed with the object and
    cannot be freed under a call that is still running."""

    def __init__(self, sample_rate_hz: int) -> None:
        lib = self._lib = load()
        self.sample_rate_hz = sample_rate_hz
        self._state = ctypes.create_string_buffer(lib.opus_encoder_get_size(1))
        code = lib.opus_encoder_init(self._state, sample_rate_hz, 1, OPUS_APPLICATION_AUDIO)
        if code != OPUS_OK:
            raise LibopusError(f"opus_encoder_init at {sample_rate_hz} Hz: {_strerror(lib, code)}")
        self._packet = ctypes.create_string_buffer(MAX_PACKET_BYTES)
        complexity = ctypes.c_int(COMPLEXITY)
        code = lib.opus_encoder_ctl(self._state, OPUS_SET_COMPLEXITY_REQUEST, complexity)
        if code != OPUS_OK:
            log.warning("libopus refused complexity %d: %s", COMPLEXITY, _strerror(lib, code))
        self.lookahead = self._lookahead()

    def _lookahead(self) -> int:
        """The encoder's delay in samples at its rate: what a decoder skips (the Ogg
        stream's pre-skip). Asked of libopus; its documented value (2.5 ms + 4 ms at this
        rate, the CELT look-ahead and the delay compensation) if the call fails."""
        samples = ctypes.c_int(-1)
        code = self._lib.opus_encoder_ctl(
            self._state, OPUS_GET_LOOKAHEAD_REQUEST, ctypes.byref(samples)
        )
        if code == OPUS_OK and samples.value >= 0:
            return samples.value
        return self.sample_rate_hz // 400 + self.sample_rate_hz // 250

    def encode(self, pcm16: bytes) -> bytes:
        """One Opus packet of these samples (pcm16 little-endian, mono; 2.5, 5, 10, 20, 40,
        60, 80, 100 or 120 ms of them). The GIL is released while libopus works."""
        frame = len(pcm16) // 2
        size = self._lib.opus_encode(self._state, pcm16, frame, self._packet, MAX_PACKET_BYTES)
        if size < 0:
            raise LibopusError(f"opus_encode of {frame} samples: {_strerror(self._lib, size)}")
        return ctypes.string_at(self._packet, size)
