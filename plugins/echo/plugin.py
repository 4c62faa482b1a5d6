"""The echo plugin: capabilities, session policy and the plan for one response.

The response to a committed turn is the turn's own audio (at the model's
24 kHz), streamed in 100 ms chunks, with the transcript `echo <N> ms` where N
is the committed audio's duration in whole milliseconds. Pacing is real time
unless the session sets `extra_body.pace` (0 = as fast as possible, 2 = twice
real time, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from plugins.echo.stage import EchoStagePort
from shared.contracts import (
    DuplexCapabilities,
    DuplexModelPlugin,
    DuplexRuntimeConfigError,
    DuplexSessionConfig,
    ResponsePlanRequest,
    SessionRuntimeConfig,
    StagePlan,
    StagePort,
    last_user_text,
)

CHUNK_MS = 100


@dataclasses.dataclass(frozen=True)
class EchoRequest:
    """The payload of one echo stage submission."""

    audio: np.ndarray  # mono float32 at `sample_rate_hz`
    sample_rate_hz: int
    output_rate_hz: int
    transcript: str
    pace: float = 1.0
    chunk_ms: int = CHUNK_MS


def _read_pace(extra_body: Mapping[str, Any]) -> float:
    pace = extra_body.get("pace", 1.0)
    if not isinstance(pace, int | float) or isinstance(pace, bool) or pace < 0:
        raise DuplexRuntimeConfigError(
            "invalid_duplex_runtime_config",
            "extra_body.pace must be a number >= 0",
            param="extra_body.pace",
        )
    return float(pace)


class EchoPlugin(DuplexModelPlugin):
    plugin_id = "echo"
    output_sample_rate_hz = 24_000

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
        _read_pace(extra_body)

    async def prepare_runtime_config(self, config: DuplexSessionConfig) -> dict[str, Any]:
        return {"pace": _read_pace(config.extra_body)}

    def runtime_config_for_update(
        self, runtime_config: Mapping[str, Any], config: DuplexSessionConfig
    ) -> dict[str, Any]:
        return {**runtime_config, "pace": _read_pace(config.extra_body)}

    def create_stage_port(self, runtime: SessionRuntimeConfig) -> StagePort:
        return EchoStagePort()

    def plan_response(self, request: ResponsePlanRequest) -> StagePlan:
        turn = request.turn
        payload = EchoRequest(
            audio=turn.audio,
            sample_rate_hz=turn.sample_rate_hz,
            output_rate_hz=self.output_sample_rate_hz,
            transcript=f"echo {turn.duration_ms} ms",
            pace=float(request.runtime_config.get("pace", 1.0)),
        )
        return StagePlan(request.request_id, request.fence, "stage0", payload)

    async def chat_completion(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return f"echo: {last_user_text(messages)}"
