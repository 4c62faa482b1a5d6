"""Pipecat's GPT-Live service as a client of duplex serve: `OpenAILiveLLMService`
(`pipecat.services.openai.live.llm`) on OpenAI's GPT-Live protocol (`/v1/live/sessions`), in
a pipeline without a transport, as its docs set it up: the context aggregators around it and an
`LLMRunFrame` to start the session (session.start goes out with the first LLMContextFrame).
Microphone audio is queued into the pipeline as InputAudioRawFrames (the service drops them
until session.started); a processor after the service records the speech audio and text it
pushes. The service has no mute and no session.update of its own making (only when the
context's tools change), so the scenario is:

- `started`: session.start is answered by session.started;
- `speak`: a tone said to the echo frame model comes back as SpeechOutputAudioRawFrames, and
  its transcript ("." while it speaks) as TTSTextFrames;
- `close`: an EndFrame makes the service send session.close and wait (up to 10 s, else a
  warning) for session.closed before it disconnects.

Pipecat parses every server event with its own models: one it cannot parse is dropped with a
warning, so no warning is allowed.

    .venv-frameworks/bin/python tests/frameworks/clients/pipecat_live_client.py \
        --url http://127.0.0.1:8000 --api-key KEY --model frame_echo
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import numpy as np
from _common import RATE, Microphone, StepFailed
from gpt_live_client import TONES, LiveReport, parse_args, run_scenario, tone, which_tone
from loguru import logger
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    LLMRunFrame,
    SpeechOutputAudioRawFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.openai.live import events
from pipecat.services.openai.live.llm import OpenAILiveLLMService
from pipecat.workers.runner import WorkerRunner

FRAMEWORK = "pipecat_live"


class Sink(FrameProcessor):
    """After the service (where a transport output would be): records what it pushes."""

    def __init__(self, report: LiveReport) -> None:
        super().__init__()
        self.report = report
        #: the model's turns the service ended (TTSStoppedFrame: 0.8 s without its transcript)
        self.turns_ended = 0

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        report = self.report
        report.client_event(f"frame:{type(frame).__name__}")
        if isinstance(frame, SpeechOutputAudioRawFrame):
            report.audio_frames += 1
            report.audio_samples += len(frame.audio) // 2
            if (name := which_tone(np.frombuffer(frame.audio, dtype=np.int16))) is not None:
                report.heard[name] += 1
            report.notify()
        elif isinstance(frame, TTSTextFrame):
            report.transcript.append({"text": frame.text})
            report.notify()
        elif isinstance(frame, TTSStoppedFrame):
            self.turns_ended += 1
            report.notify()
        elif isinstance(frame, ErrorFrame):
            report.errors.append(f"ErrorFrame: {frame.error}"[:500])
            report.notify()
        await self.push_frame(frame, direction)


class ErrorRecording(FrameProcessor):
    """Before the service: ErrorFrames go upstream, so they are seen here."""

    def __init__(self, report: LiveReport) -> None:
        super().__init__()
        self.report = report

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, ErrorFrame):
            self.report.errors.append(f"ErrorFrame: {frame.error}"[:500])
            self.report.notify()
        await self.push_frame(frame, direction)


def capture_server_events(report: LiveReport) -> None:
    """Every server event the service parses, recorded raw (the service has no hook)."""
    parse = events.parse_server_event

    def recording_parse(message: str | bytes) -> Any:
        try:
            report.live_event(json.loads(message))
        except Exception as error:  # never break the service's receive loop
            report.errors.append(f"recording a server event: {error!r}")
        return parse(message)

    events.parse_server_event = recording_parse


def capture_loguru(report: LiveReport) -> None:
    logger.remove()

    def sink(message: Any) -> None:
        record = message.record
        report.warnings.add(record["name"] or "", record["level"].name, record["message"])

    logger.add(sink, level="WARNING")


def check(step: str, condition: bool, why: str) -> None:
    if not condition:
        raise StepFailed(step, why)


async def main(args: argparse.Namespace, report: LiveReport) -> None:
    capture_loguru(report)
    capture_server_events(report)
    record_client_events(report)
    ws_url = args.url.replace("http", "ws", 1).rstrip("/")
    service = OpenAILiveLLMService(
        api_key=args.api_key,
        base_url=f"{ws_url}/v1/live/sessions",
        settings=OpenAILiveLLMService.Settings(
            model=args.model, system_instruction="You are a helpful assistant."
        ),
    )
    started: list[Any] = []

    @service.event_handler("on_session_started")
    async def on_session_started(_service: Any, session: Any) -> None:
        started.append(session.id)
        report.notify()

    user, assistant = LLMContextAggregatorPair(LLMContext())
    sink = Sink(report)
    pipeline = Pipeline([ErrorRecording(report), user, service, sink, assistant])
    task = PipelineWorker(
        pipeline,
        params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE),
        idle_timeout_secs=None,
        enable_rtvi=False,
    )

    async def push(pcm: bytes) -> None:
        await task.queue_frame(InputAudioRawFrame(audio=pcm, sample_rate=RATE, num_channels=1))

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(task)
    running = asyncio.create_task(runner.run())
    running.add_done_callback(lambda _: report.notify())
    mic = Microphone(push, idle_silence=True).start()
    server = report.server_events
    ended = False
    try:
        # how a Pipecat app starts: the context goes to the service, which starts the session
        await task.queue_frames([LLMRunFrame()])
        await report.until("started", lambda: started or report.errors)
        report.step("started", session_id=started[0] if started else None)
        check("started", bool(started), f"no session: {report.errors}")

        await mic.say(tone(TONES["speak"], 2.0))
        await report.until(
            "speak", lambda: (report.heard["speak"] and report.transcript) or report.errors
        )
        report.step(
            "speak",
            heard=report.heard["speak"],
            transcript="".join(d["text"] for d in report.transcript),
        )
        check("speak", not report.errors, f"errors: {report.errors}")
        # the caller hangs up once the model's turn is over (the service ends it 0.8 s after
        # its last transcript): a transcript after session.close would open a turn whose
        # timer the disconnect leaves behind (Pipecat warns of a dangling task)
        await report.until("speak", lambda: sink.turns_ended)

        await mic.stop()
        ended = True
        await task.queue_frame(EndFrame())
        await report.until("close", running.done, timeout=30)
        closing = report.last_events.get("session.closed")
        report.step(
            "close",
            session_closed=bool(closing),
            reason=(closing or {}).get("reason"),
            usage=(closing or {}).get("usage"),
            client_close_sent=report.client_events["session.close"],
        )
        check("close", bool(closing), f"no session.closed; server events: {dict(server)}")
    finally:
        await mic.stop()
        if not ended:
            await task.queue_frame(EndFrame())
        try:
            await asyncio.wait_for(running, 15)
        except TimeoutError:
            await task.cancel()


def record_client_events(report: LiveReport) -> None:
    """Every client event the service sends, by type (the service's one way out)."""
    send = OpenAILiveLLMService.send_client_event

    async def recording_send(self: OpenAILiveLLMService, event: Any) -> None:
        report.client_event(str(event.type))
        await send(self, event)

    OpenAILiveLLMService.send_client_event = recording_send  # type: ignore[method-assign]


if __name__ == "__main__":
    run_scenario(
        FRAMEWORK, parse_args("Pipecat OpenAILiveLLMService against duplex", FRAMEWORK), main
    )
