"""Turn detection of a session (contract 4.2): `server_vad`, or `semantic_vad`.

Both run the server VAD (Silero, services/worker/engine/vad.py); `semantic_vad` ends a
turn after a silence set by its `eagerness` (`SEMANTIC_VAD_SILENCE_MS`), the fallback of
the worker's transcript-aware decision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shared.protocol.realtime.errors import RealtimeProtocolError

JSON = dict[str, Any]

MIN_SPEECH_DURATION_FLOOR_MS = 32
SERVER_VAD = "server_vad"
SEMANTIC_VAD = "semantic_vad"
TURN_DETECTION_TYPES = (SERVER_VAD, SEMANTIC_VAD)
#: semantic_vad's `silence_duration_ms` per `eagerness`: the silence that ends a turn when
#: the worker's transcript-aware decision has nothing better
#: (services/worker/engine/semantic_turn.py)
SEMANTIC_VAD_SILENCE_MS = {"low": 1500, "medium": 800, "auto": 800, "high": 300}


def number(
    value: Any,
    param: str,
    *,
    minimum: float = 0.0,
    exclusive: bool = False,
    code: str = "invalid_session_config",
) -> float | int:
    """`value` when it is a number (not a bool) at or above `minimum` (above: `exclusive`);
    else a `code` error naming `param`."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and (value > minimum if exclusive else value >= minimum):
        return value
    bound = f"> {minimum}" if exclusive else f">= {minimum}"
    raise RealtimeProtocolError(code, f"{param} must be a number {bound}", param=param)


def _td_error(message: str) -> RealtimeProtocolError:
    return RealtimeProtocolError("unsupported_turn_detection", message, param="turn_detection")


@dataclasses.dataclass(frozen=True)
class TurnDetection:
    """Server VAD (Silero), one detector per session: `server_vad`, or `semantic_vad`,
    which for now is the server VAD with its silence set by `eagerness`.

    `idle_timeout_ms` (server_vad) is stored and echoed, not acted on yet.
    `interrupt_response=False` is refused unless the caller allows it (the openai
    surface: speech then does not cancel the active response)."""

    type: str = SERVER_VAD
    threshold: float = 0.5
    prefix_padding_ms: int | float = 300
    silence_duration_ms: int | float = 500
    min_speech_duration_ms: int | float = 96
    create_response: bool = True
    interrupt_response: bool = True
    eagerness: str | None = None
    idle_timeout_ms: int | None = None

    @classmethod
    def from_realtime(cls, value: Any, *, allow_no_interrupt: bool = False) -> TurnDetection:
        if not isinstance(value, Mapping):
            raise _td_error("turn_detection must be an object or null")
        # a null field means its default: SDKs serialise unset optional fields as null
        value = {k: v for k, v in value.items() if v is not None}
        kind = value.get("type", SERVER_VAD)
        if kind not in TURN_DETECTION_TYPES:
            raise _td_error(f"unsupported turn detection type {kind!r}: server_vad or semantic_vad")
        default = cls()
        threshold = value.get("threshold", default.threshold)
        if (
            not isinstance(threshold, int | float)
            or isinstance(threshold, bool)
            or not 0 < threshold <= 1
        ):
            raise _td_error("threshold must be a number in (0, 1]")

        def ms(key: str, *, positive: bool = False) -> int | float:
            raw = value.get(key, getattr(default, key))
            try:
                return number(raw, key, exclusive=positive, code="unsupported_turn_detection")
            except RealtimeProtocolError as exc:
                raise _td_error(exc.message) from None

        flags = {}
        for key in ("create_response", "interrupt_response"):
            flag = value.get(key, True)
            if not isinstance(flag, bool):
                raise _td_error(f"{key} must be a boolean")
            flags[key] = flag
        if not flags["interrupt_response"] and not allow_no_interrupt:
            raise _td_error("interrupt_response=false is not supported: speech always interrupts")
        idle = value.get("idle_timeout_ms")
        if idle is not None and (not isinstance(idle, int) or isinstance(idle, bool) or idle <= 0):
            raise _td_error("idle_timeout_ms must be a positive integer or null")
        eagerness = None
        silence = ms("silence_duration_ms", positive=True)
        if kind == SEMANTIC_VAD:
            eagerness = value.get("eagerness", "auto")
            # a dict lookup: a list or an object would raise TypeError (unhashable)
            if not isinstance(eagerness, str) or eagerness not in SEMANTIC_VAD_SILENCE_MS:
                raise _td_error("eagerness must be one of low, medium, high, auto")
            silence = SEMANTIC_VAD_SILENCE_MS[eagerness]
        return cls(
            type=kind,
            threshold=float(threshold),
            prefix_padding_ms=ms("prefix_padding_ms"),
            silence_duration_ms=silence,
            min_speech_duration_ms=max(ms("min_speech_duration_ms"), MIN_SPEECH_DURATION_FLOOR_MS),
            eagerness=eagerness,
            idle_timeout_ms=idle,
            **flags,
        )

    def to_realtime(self) -> JSON:
        """All settings (the duplex session object, checkpoints); the two GA-only fields
        only when set, so a duplex session's object is what it was before them."""
        out = dataclasses.asdict(self)
        for key in ("eagerness", "idle_timeout_ms"):
            if out[key] is None:
                del out[key]
        return out


__all__ = [
    "MIN_SPEECH_DURATION_FLOOR_MS",
    "SEMANTIC_VAD",
    "SEMANTIC_VAD_SILENCE_MS",
    "SERVER_VAD",
    "TURN_DETECTION_TYPES",
    "TurnDetection",
    "number",
]
