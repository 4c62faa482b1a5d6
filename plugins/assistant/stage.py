"""The assistant's stage: the answer's text (built-in responder or a vLLM text stage),
spoken sentence by sentence with espeak-ng, streamed as 100 ms audio chunks.

With a text stage, the text arrives as it is generated; each complete sentence is
synthesized and streamed while the next is still being generated. `abort` cancels the
speaking task and aborts the text request inside the engine, so nothing of an aborted
response follows.

Tool calls: a request whose `function_call` is set (the built-in responder chose a tool)
says its `reply` if any (an announcement), then emits that call; a generated answer
offered tools (`tools`: the names it may call) is read with `ToolCallText`, its calls
emitted once generation ends. A call is a "function_call" stage output, before "done".

A text response (`speak` False: the response's modalities have no audio) is not
synthesized: each sentence goes out as one "text" output, unpaced (pacing is for audio
played in real time).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from plugins.assistant.responder import sentences
from plugins.assistant.tool_text import ToolCallText
from plugins.paced import CHUNK_MS, split_text
from shared.contracts import (
    FunctionCall,
    OutputKind,
    OutputSink,
    StageOutput,
    StagePlan,
    StagePort,
    TaskStagePort,
    TextRequest,
)

log = logging.getLogger(__name__)

TEXT_ROLE = "llm"


@dataclasses.dataclass(frozen=True)
class AssistantRequest:
    """One response: a fixed reply, a prompt for the text stage, or a tool call."""

    reply: str | None = None
    prompt: str | None = None
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    pace: float = 1.0
    function_call: FunctionCall | None = None  # after saying `reply` (if any), call this
    tools: tuple[str, ...] = ()  # the tools a generated answer may call, by name
    speak: bool = True  # False: a text response, words without synthesis


class AssistantStagePort(TaskStagePort):
    def __init__(
        self, synthesize: Callable[[str], np.ndarray], rate_hz: int, text_port: StagePort | None
    ) -> None:
        super().__init__()
        self.synthesize = synthesize
        self.rate_hz = rate_hz
        self.text_port = text_port
        self._text_queues: dict[str, asyncio.Queue[StageOutput]] = {}  # llm request -> outputs

    def bind(self, session_id: str, sink: OutputSink) -> None:
        super().bind(session_id, sink)
        if self.text_port is not None:
            self.text_port.bind(session_id, self._on_text)

    async def cleanup(self, session_id: str) -> None:
        await super().cleanup(session_id)
        if self.text_port is not None:
            await self.text_port.cleanup(session_id)

    def held_sessions(self) -> frozenset[str]:
        held = super().held_sessions()
        return held if self.text_port is None else held | self.text_port.held_sessions()

    async def shutdown(self) -> None:
        if self.text_port is not None:
            await self.text_port.shutdown()

    def _on_text(self, output: StageOutput) -> None:
        queue = self._text_queues.get(output.request_id)
        if queue is not None:
            queue.put_nowait(output)

    # ------------------------------------------------------------ one response

    async def _run(self, plan: StagePlan) -> None:
        request: AssistantRequest = plan.payload
        speaker = _Speaker(self, plan, request.pace, request.speak)
        try:
            if request.prompt is not None and self.text_port is not None:
                await self._speak_generated(plan, request, speaker)
            else:
                for sentence in sentences(request.reply or "")[0] or [request.reply or ""]:
                    await speaker.say(sentence)
            if request.function_call is not None:
                self._call(plan, request.function_call)  # after what was said before it
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("assistant response %s failed", plan.request_id)
            self._fail(plan, exc)
            return
        self._emit(StageOutput(plan.request_id, plan.fence, OutputKind.DONE, text=speaker.spoken))

    async def _speak_generated(
        self, plan: StagePlan, request: AssistantRequest, speaker: _Speaker
    ) -> None:
        assert self.text_port is not None
        text_id = await self.text_port.ensure(plan.fence, TEXT_ROLE)
        queue: asyncio.Queue[StageOutput] = asyncio.Queue()
        self._text_queues[text_id] = queue
        try:
            await self.text_port.submit_initial(
                StagePlan(
                    text_id,
                    plan.fence,
                    TEXT_ROLE,
                    TextRequest(request.prompt or "", request.sampling),
                )
            )
            pending, received = "", ""
            calls = ToolCallText(request.tools) if request.tools else None
            while True:
                output = await queue.get()
                if output.kind is OutputKind.ERROR:
                    raise RuntimeError(output.message or output.error_code or "text stage failed")
                text = output.text
                if output.kind is OutputKind.DONE:
                    # "done" carries the whole text again (the vLLM stage): only what the
                    # deltas did not bring is new
                    text = text[len(received) :] if text.startswith(received) else ""
                received += text
                pending += calls.feed(text) if calls else text
                done, pending = sentences(pending)
                for sentence in done:
                    await speaker.say(sentence)
                if output.kind is OutputKind.DONE:
                    break
            if calls is not None:
                pending += calls.finish()
            if pending.strip():
                await speaker.say(pending)
            for call in calls.calls if calls else ():
                self._call(plan, call)
        finally:
            self._text_queues.pop(text_id, None)
            await self.text_port.abort([text_id])  # cancelled mid-generation (else a no-op)

    def _call(self, plan: StagePlan, call: FunctionCall) -> None:
        self._emit(
            StageOutput(plan.request_id, plan.fence, OutputKind.FUNCTION_CALL, function_call=call)
        )


class _Speaker:
    """Synthesizes sentences and streams them in chunks, paced (pace 1 = real time); or,
    for a text response (`speak` False), sends each sentence as text."""

    def __init__(
        self, port: AssistantStagePort, plan: StagePlan, pace: float, speak: bool = True
    ) -> None:
        self.port, self.plan, self.pace, self.speak = port, plan, pace, speak
        self.spoken = ""
        self._chunk = port.rate_hz * CHUNK_MS // 1000
        self._sent = 0
        self._started = time.monotonic()

    async def say(self, sentence: str) -> None:
        text = sentence.strip()
        if not text:
            return
        spoken_text = (" " if self.spoken else "") + text
        if not self.speak:
            self.spoken += spoken_text
            self.port._emit(
                StageOutput(
                    self.plan.request_id, self.plan.fence, OutputKind.TEXT, text=spoken_text
                )
            )
            await asyncio.sleep(0)  # one sentence at a time: an abort lands between them
            return
        audio = await asyncio.to_thread(self.port.synthesize, text)
        self.spoken += spoken_text
        count = max(1, -(-len(audio) // self._chunk))
        for index, piece_text in enumerate(split_text(spoken_text, count)):
            if self.pace > 0:
                due = self._started + self._sent * CHUNK_MS / 1000 / self.pace
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            else:
                await asyncio.sleep(0)
            piece = audio[index * self._chunk : (index + 1) * self._chunk]
            self.port._emit(
                StageOutput(
                    self.plan.request_id,
                    self.plan.fence,
                    OutputKind.AUDIO,
                    audio=piece.astype(np.float32),
                    sample_rate_hz=self.port.rate_hz,
                    text=piece_text,
                )
            )
            self._sent += 1
