"""The echo plugin: capabilities, session policy and the plan for one response.

The response to a committed turn is the turn's own audio (at the model's
24 kHz), streamed in 100 ms chunks, with the transcript `echo <N> ms` where N
is the committed audio's duration in whole milliseconds. Pacing is real time
unless the session sets `extra_body.pace` (0 = as fast as possible, 2 = twice
real time, ...).

A turn without audio (on the openai surface a `response.create` over the client's user
text items, or over nothing; an answer to a function output) is answered with words and
no audio: `echo: <its text>` (at most `ECHO_TEXT_CHARS` of it, cut at a word), or
`echo 0 ms` when it has no text. A text response (`output_modalities: ["text"]`) gets
the same words as its text, and the stage never resamples the audio for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from plugins.echo.stage import EchoStagePort
from plugins.paced import CHUNK_MS, PacedPlugin
from shared.contracts import (
    ResponsePlanRequest,
    SessionRuntimeConfig,
    StagePlan,
    StagePort,
    last_user_text,
)


@dataclasses.dataclass(frozen=True)
class EchoRequest:
    """The payload of one echo stage submission."""

    audio: np.ndarray  # mono float32 at `sample_rate_hz`
    sample_rate_hz: int
    output_rate_hz: int
    transcript: str
    pace: float = 1.0
    chunk_ms: int = CHUNK_MS
    speak: bool = True  # False: a text response, the transcript alone


#: the most of a text turn's text echo repeats (a framework may send a whole saved context)
ECHO_TEXT_CHARS = 80


def echo_transcript(audio_ms: int, has_audio: bool, text: str) -> str:
    """What echo says to a turn (module head)."""
    if has_audio or not text.strip():
        return f"echo {audio_ms} ms"
    said = " ".join(text.split())
    if len(said) > ECHO_TEXT_CHARS:
        said = said[:ECHO_TEXT_CHARS].rsplit(" ", 1)[0] + " ..."
    return f"echo: {said}"


class EchoPlugin(PacedPlugin):
    plugin_id = "echo"
    output_sample_rate_hz = 24_000

    def create_stage_port(self, runtime: SessionRuntimeConfig) -> StagePort:
        return EchoStagePort()

    def plan_response(self, request: ResponsePlanRequest) -> StagePlan:
        turn = request.turn
        payload = EchoRequest(
            audio=turn.audio,
            sample_rate_hz=turn.sample_rate_hz,
            output_rate_hz=self.output_sample_rate_hz,
            transcript=echo_transcript(turn.duration_ms, turn.audio.size > 0, turn.text),
            pace=float(request.runtime_config.get("pace", 1.0)),
            speak=request.audio_output,
        )
        return StagePlan(request.request_id, request.fence, "stage0", payload)

    async def chat_completion(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return f"echo: {last_user_text(messages)}"
