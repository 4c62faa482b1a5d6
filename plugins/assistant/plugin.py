"""The assistant plugin: a cascaded full-duplex voice assistant on the CPU.

Turn taking and barge-in come from the engine's server VAD (Silero); each committed turn
is recognised with pocketsphinx (`transcribe`, on the executor), answered by the built-in
responder or, with `--llm-model PATH`, by a vLLM text stage, and spoken with espeak-ng.
Everything it needs ships inside Python packages: no model download, no system package.

Options: `duplex worker --plugin assistant --llm-model PATH` (or DUPLEX_LLM_MODEL) makes the
worker build its vLLM stage and hand it over as `text_stage`; DUPLEX_ASSISTANT_ASR=hybrid|lm|grammar
picks the recogniser's mode (asr.py; hybrid by default).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from plugins.assistant.asr import SphinxRecognizer
from plugins.assistant.responder import llm_prompt, reply, understands
from plugins.assistant.stage import AssistantRequest, AssistantStagePort
from plugins.assistant.tts import EspeakSynthesizer
from plugins.paced import PacedPlugin
from shared.contracts import (
    ResponsePlanRequest,
    SessionRuntimeConfig,
    StagePlan,
    StagePort,
    last_user_text,
)


class AssistantPlugin(PacedPlugin):
    plugin_id = "assistant"
    output_sample_rate_hz = 22_050  # espeak-ng's voices

    def __init__(self, text_stage: StagePort | None = None, asr_mode: str = "hybrid") -> None:
        if asr_mode not in ("hybrid", "lm", "grammar"):
            raise ValueError(f"unknown recognition mode {asr_mode!r}: hybrid, lm or grammar")
        self.asr_mode = asr_mode
        self.recognizer = SphinxRecognizer("grammar" if asr_mode == "grammar" else "lm")
        self.commands = SphinxRecognizer("grammar") if asr_mode == "hybrid" else None
        self.text_stage = text_stage
        self.sampling_defaults: dict[str, Any] = {"temperature": 0.7, "max_tokens": 64}

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> AssistantPlugin:
        return cls(options.get("text_stage"), options.get("asr", "hybrid"))

    def create_stage_port(self, runtime: SessionRuntimeConfig) -> StagePort:
        synthesizer = EspeakSynthesizer.shared()
        return AssistantStagePort(
            synthesizer.synthesize, synthesizer.sample_rate_hz, self.text_stage
        )

    def transcribe(self, audio: np.ndarray, sample_rate_hz: int) -> str | None:
        """Free speech first; when its words make no command, the command grammar (fast,
        and exact where the language model stumbles: "what i read it" -> the time)."""
        heard = self.recognizer.recognize(audio, sample_rate_hz)
        if self.commands is not None and not understands(heard):
            command = self.commands.recognize(audio, sample_rate_hz)
            if command:
                return command
        return heard

    def plan_response(self, request: ResponsePlanRequest) -> StagePlan:
        turn = request.turn
        heard = " ".join(t for t in (turn.transcript, turn.text) if t).strip()
        pace = float(request.runtime_config.get("pace", 1.0))
        if self.text_stage is not None:
            sampling = dict(self.sampling_defaults)
            if request.config.temperature is not None:
                sampling["temperature"] = request.config.temperature
            payload = AssistantRequest(
                prompt=llm_prompt(request.history, heard, request.config.instructions or ""),
                sampling=sampling,
                pace=pace,
            )
        else:
            payload = AssistantRequest(reply=reply(heard), pace=pace)
        return StagePlan(request.request_id, request.fence, "stage0", payload)

    async def chat_completion(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return reply(last_user_text(messages))
