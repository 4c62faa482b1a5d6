"""Readers of the OpenAI session object (beta flat keys and GA nested keys).

A session object may say the same thing two ways (`input_audio_format` vs
`audio.input.format`, `modalities` vs `output_modalities`): the readers here
are the one place that knows both spellings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shared.protocol.realtime.errors import RealtimeProtocolError
from shared.protocol.realtime.formats import (
    PCM16,
    AudioFormat,
    parse_audio_format,
    validate_rate,
)

_ABSENT = object()


def _nested(session: Mapping[str, Any], *path: str) -> Any:
    node: Any = session
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return _ABSENT
        node = node[key]
    return node


def read_input_format(
    session: Mapping[str, Any], fallback: AudioFormat | None = None
) -> AudioFormat | None:
    """The declared input format, or None when the session object declares none."""
    ga = _nested(session, "audio", "input", "format")
    ga_rate = _nested(session, "audio", "input", "sample_rate_hz")
    rate = None if ga_rate is _ABSENT else ga_rate
    if ga is not _ABSENT and ga is not None:
        return parse_audio_format(ga, rate=rate, param="audio.input.format", fallback=fallback)
    flat = session.get("input_audio_format")
    if flat is not None:
        flat_rate = session.get("input_audio_sample_rate", rate)
        return parse_audio_format(
            flat, rate=flat_rate, param="input_audio_format", fallback=fallback
        )
    return None


def read_output_format(
    session: Mapping[str, Any], fallback: AudioFormat | None = None
) -> AudioFormat | None:
    ga = _nested(session, "audio", "output", "format")
    # `audio.output.sample_rate_hz`: where vLLM-Omni's DuplexClient asks for its output
    # rate (its `output_audio_format` names only the encoding); beside `audio.output.format`
    # it is what a format without a rate of its own takes
    ga_rate = _nested(session, "audio", "output", "sample_rate_hz")
    rate = None if ga_rate is _ABSENT else ga_rate
    if ga is not _ABSENT and ga is not None:
        return parse_audio_format(
            ga, rate=rate, output=True, param="audio.output.format", fallback=fallback
        )
    flat = session.get("output_audio_format")
    if flat is not None:
        return parse_audio_format(
            flat, rate=rate, output=True, param="output_audio_format", fallback=fallback
        )
    if rate is not None and fallback is not None:  # a rate alone: the encoding in force
        return AudioFormat(
            fallback.encoding, validate_rate(rate, param="audio.output.sample_rate_hz")
        )
    return None


def read_turn_detection(session: Mapping[str, Any]) -> tuple[bool, Any]:
    """(declared?, value): `turn_detection` or `audio.input.turn_detection`."""
    if "turn_detection" in session:
        return True, session["turn_detection"]
    nested = _nested(session, "audio", "input", "turn_detection")
    if nested is not _ABSENT:
        return True, nested
    return False, None


def read_modalities(session: Mapping[str, Any]) -> list[str] | None:
    value = session.get("output_modalities", session.get("modalities"))
    if value is None:
        return None
    if not isinstance(value, list) or not all(m in ("text", "audio") for m in value):
        raise RealtimeProtocolError(
            "invalid_session_config",
            "modalities must be a list of 'text'/'audio'",
            param="modalities",
        )
    return list(value)


def read_max_tokens(obj: Mapping[str, Any]) -> tuple[bool, int | None]:
    """(declared?, limit) from `max_response_output_tokens` | `max_output_tokens` |
    `max_tokens`; "inf" means no limit."""
    for key in ("max_response_output_tokens", "max_output_tokens", "max_tokens"):
        if key in obj:
            value = obj[key]
            if value is None or value == "inf":
                return True, None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return True, value
            raise RealtimeProtocolError(
                "invalid_session_config", f"{key} must be a positive integer or 'inf'", param=key
            )
    return False, None


def read_voice(obj: Mapping[str, Any]) -> Any:
    nested = _nested(obj, "audio", "output", "voice")
    return obj.get("voice") if nested is _ABSENT else nested


def read_speed(obj: Mapping[str, Any]) -> Any:
    nested = _nested(obj, "audio", "output", "speed")
    return obj.get("speed") if nested is _ABSENT else nested


@dataclasses.dataclass(frozen=True)
class InputAudioDefaults:
    """What an append without a declared format means (RealtimeInputDefaults).

    Input pcm16 at 16 kHz, output pcm16 at the model's rate, silence RMS 0.003.
    Remembered per session and restored on reconnect.
    """

    input_format: AudioFormat = AudioFormat(PCM16, 16_000)
    output_format: AudioFormat = AudioFormat(PCM16, None)
    overlap_silence_rms: float = 0.003

    def updated(self, session: Mapping[str, Any]) -> InputAudioDefaults:
        """These defaults after a session object (create or update) declared its formats."""
        input_format = read_input_format(session, self.input_format) or self.input_format
        output_format = read_output_format(session, self.output_format) or self.output_format
        rms = session.get(
            "overlap_silence_rms", _nested(session, "extra_body", "overlap_silence_rms")
        )
        if rms is _ABSENT or rms is None:
            rms = self.overlap_silence_rms
        if not isinstance(rms, int | float) or isinstance(rms, bool) or rms < 0:
            raise RealtimeProtocolError(
                "invalid_session_config",
                "overlap_silence_rms must be a number >= 0",
                param="overlap_silence_rms",
            )
        return InputAudioDefaults(input_format, output_format, float(rms))
