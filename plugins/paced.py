"""What the CPU plugins (echo, assistant) share: output paced in chunks of 100 ms.

`extra_body.pace` sets the pace of a session's audio (1 = real time, 2 = twice as fast,
0 = as fast as possible); any other value must lie in `PACE_MIN`-`PACE_MAX`. The
capabilities are those of a chunked, interruptible, resumable model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.contracts import (
    DuplexCapabilities,
    DuplexModelPlugin,
    DuplexRuntimeConfigError,
    DuplexSessionConfig,
)

CHUNK_MS = 100
#: Slowest pace: 10x slower than real time. A tiny pace (1e-9) would hold a stage
#: for years per chunk; NaN and inf compare false and slipped past a `< 0` check.
PACE_MIN = 0.1
#: Fastest paced value: beyond 10x real time, ask for 0 (unpaced) instead.
PACE_MAX = 10.0


def read_pace(extra_body: Mapping[str, Any]) -> float:
    """`extra_body.pace`: 0 (unpaced) or a number in PACE_MIN-PACE_MAX; anything else
    (negative, NaN, inf, 1e9, a string, a bool) is refused, not clamped, so a client
    learns its value was not used."""
    pace = extra_body.get("pace", 1.0)
    # range first: NaN fails every comparison, and float() of a huge int would overflow
    if (
        not isinstance(pace, int | float)
        or isinstance(pace, bool)
        or not (pace == 0 or PACE_MIN <= pace <= PACE_MAX)
    ):
        raise DuplexRuntimeConfigError(
            "invalid_duplex_runtime_config",
            f"extra_body.pace must be 0 (as fast as possible) or a number in "
            f"{PACE_MIN:g}-{PACE_MAX:g}, got {pace!r:.40}",
            param="extra_body.pace",
        )
    return float(pace)


def split_text(text: str, pieces: int) -> list[str]:
    """`text` in `pieces` consecutive parts (the last ones may be empty) that join back to it:
    a transcript spread over the audio chunks that carry it."""
    bounds = [round(i * len(text) / pieces) for i in range(pieces + 1)]
    return [text[bounds[i] : bounds[i + 1]] for i in range(pieces)]


class PacedPlugin(DuplexModelPlugin):
    """A plugin whose stage streams audio in `CHUNK_MS` chunks at `extra_body.pace`."""

    def capabilities(self, max_sessions: int) -> DuplexCapabilities:
        return DuplexCapabilities(
            supports_barge_in=True,
            supports_playback_ack=True,
            supports_audio_truncate=True,
            supports_session_lease=True,
            supports_session_resume=True,
            supports_chat_completions=True,
            supports_realtime_endpoint=True,
            supports_independent_io_streams=True,
            supports_multi_session=max_sessions > 1,
            supports_multi_session_same_replica=max_sessions > 1,
            session_admission_mode="engine_managed",
            chunk_period_ms=CHUNK_MS,
            target_barge_in_latency_ms=CHUNK_MS,
        )

    def validate_client_extra_body(self, extra_body: Mapping[str, Any]) -> None:
        super().validate_client_extra_body(extra_body)
        read_pace(extra_body)

    async def prepare_runtime_config(self, config: DuplexSessionConfig) -> dict[str, Any]:
        return {"pace": read_pace(config.extra_body)}

    def runtime_config_for_update(
        self, runtime_config: Mapping[str, Any], config: DuplexSessionConfig
    ) -> dict[str, Any]:
        return {**runtime_config, "pace": read_pace(config.extra_body)}
