"""The assistant plugin: a cascaded full-duplex voice assistant on the CPU.

Turn taking and barge-in come from the engine's server VAD (Silero); each committed turn
is recognised with Whisper tiny.en (`transcribe`, on the executor; partial transcripts
while the user speaks, `transcribe_partial`) or pocketsphinx, answered by the built-in
responder or, with `--llm-model PATH`, by a vLLM text stage, and spoken with espeak-ng.
Everything it needs ships inside Python packages: no model download, no system package.

Options: `duplex worker --plugin assistant --llm-model PATH` (or DUPLEX_LLM_MODEL) makes the
worker build its vLLM stage and hand it over as `text_stage`; the `asr` option
(DUPLEX_ASSISTANT_ASR) picks the recogniser: `whisper` (whisper.py, the default), or
pocketsphinx (asr.py) as `sphinx` (= `hybrid`), `lm` or `grammar`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from plugins.assistant.asr import SphinxRecognizer
from plugins.assistant.responder import (
    GREETING,
    announcement,
    llm_prompt,
    reply,
    tool_answer,
    tool_call_for,
    understands,
)
from plugins.assistant.stage import AssistantRequest, AssistantStagePort
from plugins.assistant.tts import EspeakSynthesizer
from plugins.assistant.whisper import WhisperRecognizer
from plugins.paced import PacedPlugin
from shared.contracts import (
    ResponsePlanRequest,
    SessionRuntimeConfig,
    StagePlan,
    StagePort,
    last_user_text,
)
from shared.contracts.tools import callable_tools

#: an LLM offered tools may generate at least this many tokens: a call's JSON is longer
#: than the one short sentence the default allows
TOOL_CALL_MAX_TOKENS = 256


#: the `asr` option: Whisper (default), or pocketsphinx's modes (`sphinx` is `hybrid`)
ASR_MODES = ("whisper", "sphinx", "hybrid", "lm", "grammar")


class AssistantPlugin(PacedPlugin):
    plugin_id = "assistant"
    output_sample_rate_hz = 22_050  # espeak-ng's voices

    def __init__(self, text_stage: StagePort | None = None, asr_mode: str = "whisper") -> None:
        if asr_mode not in ASR_MODES:
            raise ValueError(f"unknown recognition mode {asr_mode!r}: {', '.join(ASR_MODES)}")
        asr_mode = "hybrid" if asr_mode == "sphinx" else asr_mode
        self.asr_mode = asr_mode
        self.recognizer: WhisperRecognizer | SphinxRecognizer
        if asr_mode == "whisper":
            # the model loads on first use (from_options loads it at worker start)
            self.recognizer = WhisperRecognizer()
        else:
            self.recognizer = SphinxRecognizer("grammar" if asr_mode == "grammar" else "lm")
        self.commands = SphinxRecognizer("grammar") if asr_mode == "hybrid" else None
        self.text_stage = text_stage
        self.sampling_defaults: dict[str, Any] = {"temperature": 0.7, "max_tokens": 64}

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> AssistantPlugin:
        plugin = cls(options.get("text_stage"), options.get("asr") or "whisper")
        if isinstance(plugin.recognizer, WhisperRecognizer):
            # a worker verifies the model's checksum and loads it before taking sessions:
            # a wrong model fails the start, and the first turn does not wait ~1 s for it
            plugin.recognizer.load()
        return plugin

    def create_stage_port(self, runtime: SessionRuntimeConfig) -> StagePort:
        synthesizer = EspeakSynthesizer.shared()
        return AssistantStagePort(
            synthesizer.synthesize, synthesizer.sample_rate_hz, self.text_stage
        )

    def transcribe(self, audio: np.ndarray, sample_rate_hz: int) -> str | None:
        """The recogniser's words. In hybrid mode free speech first and, when its words
        make no command, the command grammar (fast, and exact where pocketsphinx's language
        model stumbles: "what i read it" -> the time). Whisper needs no such help."""
        heard = self.recognizer.recognize(audio, sample_rate_hz)
        if self.commands is not None and not understands(heard):
            command = self.commands.recognize(audio, sample_rate_hz)
            if command:
                return command
        return heard

    @property
    def transcribes_partials(self) -> bool:
        """Whisper only: pocketsphinx would decode the whole turn again for each partial at
        about 0.2 of real time, for words its final pass often changes."""
        return self.asr_mode == "whisper"

    def transcribe_partial(self, audio: np.ndarray, sample_rate_hz: int) -> str | None:
        """The words of the turn so far (greedy decoding: a preview, on the executor)."""
        if not isinstance(self.recognizer, WhisperRecognizer):
            return None
        return self.recognizer.partial(audio, sample_rate_hz)

    def plan_response(self, request: ResponsePlanRequest) -> StagePlan:
        """The answer to a turn, to the function outputs that end history, or to the
        client's text items (a turn without audio); with no input at all, a greeting.
        Tools: responder.py (built-in) and tool_text.py (LLM). A text response is not
        synthesized (`speak`); max_output_tokens also bounds the LLM's generation."""
        turn = request.turn
        heard = " ".join(t for t in (turn.transcript, turn.text) if t).strip()
        # a turn the user spoke (the recogniser heard it); any other's words are in history
        spoken_turn = turn.audio.size > 0 or turn.transcript is not None
        pace = float(request.runtime_config.get("pace", 1.0))
        speak = request.audio_output
        tools, choice = request.tools, request.tool_choice
        if self.text_stage is not None:
            sampling = dict(self.sampling_defaults)
            if request.config.temperature is not None:
                sampling["temperature"] = request.config.temperature
            offered = callable_tools(tools, choice)
            if offered:
                sampling["max_tokens"] = max(
                    int(sampling.get("max_tokens") or 0), TOOL_CALL_MAX_TOKENS
                )
            if request.max_output_tokens is not None:  # the client's limit wins (GA: calls too)
                sampling["max_tokens"] = request.max_output_tokens
            instructions = request.config.instructions or ""
            prompt = llm_prompt(
                request.history, heard, instructions, tools, choice, user_turn=spoken_turn
            )
            payload = AssistantRequest(
                prompt=prompt,
                sampling=sampling,
                pace=pace,
                tools=tuple(str(tool["name"]) for tool in offered),
                speak=speak,
            )
        else:
            answer = None if heard else tool_answer(request.history)
            call = None if answer is not None else tool_call_for(heard, tools, choice)
            if answer is None and not heard and not spoken_turn:
                answer = GREETING  # asked to speak first: nothing was said or written
            if call is not None:
                announce = request.config.extra_body.get("announce_tool_calls") is True
                said = announcement(call) if announce else None
                payload = AssistantRequest(reply=said, function_call=call, pace=pace, speak=speak)
            else:
                payload = AssistantRequest(reply=answer or reply(heard), pace=pace, speak=speak)
        return StagePlan(request.request_id, request.fence, "stage0", payload)

    async def chat_completion(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return reply(last_user_text(messages))
