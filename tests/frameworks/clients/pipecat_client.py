"""Pipecat as a client of duplex serve: its OpenAIRealtimeLLMService in a pipeline without a
transport. Microphone audio is queued into the pipeline task as InputAudioRawFrames; a
processor after the service records the TTS audio and text it pushes. With `manual`, server
turn detection is off and Pipecat's own Silero VAD in the user aggregator drives the turns
(commit + response.create at the end of speech, an interruption when speech starts).

    .venv-frameworks/bin/python tests/frameworks/clients/pipecat_client.py \
        --url http://127.0.0.1:8000 --scenario defaults_turns --speech hello=hello.wav ...
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from _common import (
    RATE,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    TOOL_OUTPUT,
    Microphone,
    Report,
    Response,
    StepFailed,
    run,
    speech,
)
from loguru import logger
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InputAudioRawFrame,
    InterruptionFrame,
    LLMRunFrame,
    TTSAudioRawFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import (
    LLMContextAggregatorPair,
    LLMUserAggregatorParams,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.llm_service import FunctionCallParams
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.events import AudioConfiguration, AudioInput
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.workers.runner import WorkerRunner

#: Pipecat's realtime service sends and expects 24 kHz pcm16; its microphone runs at 16 kHz
MIC_RATE = 16000


class Client:
    def __init__(self, report: Report) -> None:
        self.report = report
        self.responses: dict[str, Response] = {}
        self.order: list[str] = []
        self.interruptions = 0

    def response(self, response_id: str) -> Response:
        return self.responses.setdefault(response_id, Response(response_id))

    def server_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "response.created":
            self.response(event["response"]["id"])
            self.order.append(event["response"]["id"])
        elif kind == "conversation.item.input_audio_transcription.completed":
            self.report.user_transcripts.append(event.get("transcript", ""))
        elif kind == "response.done":
            body = event["response"]
            response = self.response(body["id"])
            response.status = body.get("status")
            response.reason = (body.get("status_details") or {}).get("reason")
            response.done.set()
        self.report.server_event(event)

    def after(self, count: int) -> Response | None:
        return self.responses[self.order[count]] if len(self.order) > count else None

    async def next_response(self, step: str, count: int) -> Response:
        return await self.report.until(step, lambda: self.after(count))

    async def finished(self, step: str, response: Response) -> Response:
        await self.report.until(step, lambda: response.done.is_set())
        return response

    async def reply(self, step: str, count: int) -> Response:
        return await self.finished(step, await self.next_response(step, count))


def recording_service(client: Client) -> type[OpenAIRealtimeLLMService]:
    """The service, recording what it pushes under the response it belongs to (the frames
    themselves carry no response id)."""

    class Recording(OpenAIRealtimeLLMService):
        async def push_frame(self, frame: Frame, direction=FrameDirection.DOWNSTREAM):
            current = self._current_audio_response
            if current is not None and current.response_id:
                if isinstance(frame, TTSAudioRawFrame):
                    client.response(current.response_id).audio_samples += len(frame.audio) // 2
                    client.report.notify()
                elif isinstance(frame, TTSTextFrame):
                    client.response(current.response_id).transcript += frame.text
            if isinstance(frame, InterruptionFrame):
                client.interruptions += 1
            if isinstance(frame, ErrorFrame):
                client.report.errors.append(f"ErrorFrame: {frame.error}"[:500])
                client.report.notify()
            await super().push_frame(frame, direction)

        async def send_client_event(self, event: Any) -> None:
            kind = event.type
            item = getattr(event, "item", None)
            if item is not None:
                kind += f":{item.type}:{getattr(item, 'role', None) or ''}"
            client.report.client_event(kind)
            await super().send_client_event(event)

    return Recording


class Sink(FrameProcessor):
    """The pipeline's end: counts the frames that reach it (where a transport output is)."""

    def __init__(self, report: Report) -> None:
        super().__init__()
        self.report = report

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        self.report.client_event(f"frame:{type(frame).__name__}")
        await self.push_frame(frame, direction)


def capture_server_events(client: Client) -> None:
    """Every server event the service parses, recorded raw (the service has no hook)."""
    parse = events.parse_server_event

    def recording_parse(message: str) -> Any:
        try:
            client.server_event(json.loads(message))
        except Exception as error:  # never break the service's receive loop
            client.report.errors.append(f"recording a server event: {error!r}")
        return parse(message)

    events.parse_server_event = recording_parse


def capture_loguru(report: Report) -> None:
    logger.remove()

    def sink(message: Any) -> None:
        record = message.record
        report.warnings.add(record["name"] or "", record["level"].name, record["message"])

    logger.add(sink, level="WARNING")


async def main(args: Any, report: Report) -> None:
    capture_loguru(report)
    phrases = speech(args, MIC_RATE)
    manual = args.scenario.startswith("manual")
    client = Client(report)
    capture_server_events(client)

    properties = events.SessionProperties()
    if manual:
        properties.audio = AudioConfiguration(input=AudioInput(turn_detection=False))
    if args.scenario.endswith("tool"):
        # init-provided tools: the context's only reach the session with its first response
        properties.tools = ToolsSchema(
            standard_tools=[
                FunctionSchema(
                    name=TOOL_NAME, description=TOOL_DESCRIPTION, properties={}, required=[]
                )
            ]
        )
    ws_url = args.url.replace("http", "ws", 1)
    service = recording_service(client)(
        api_key="unused",
        base_url=f"{ws_url}/v1/realtime",
        settings=OpenAIRealtimeLLMService.Settings(model=args.model, session_properties=properties),
    )
    calls: list[dict[str, Any]] = []

    async def get_weather(params: FunctionCallParams) -> None:
        calls.append({"name": params.function_name, "arguments": params.arguments})
        if client.order:
            client.responses[client.order[-1]].function_calls.append(
                {"name": params.function_name, "arguments": json.dumps(params.arguments)}
            )
        report.notify()
        await params.result_callback(TOOL_OUTPUT)

    service.register_function(TOOL_NAME, get_weather)
    context = LLMContext()
    user_params = None
    if manual:  # Pipecat's own VAD drives the turns, as in its locally-driven-turns example
        user_params = LLMUserAggregatorParams(vad_analyzer=SileroVADAnalyzer())
    user, assistant = LLMContextAggregatorPair(context, user_params=user_params)
    pipeline = Pipeline([user, service, Sink(report), assistant])
    task = PipelineWorker(
        pipeline,
        params=PipelineParams(audio_in_sample_rate=MIC_RATE, audio_out_sample_rate=RATE),
        idle_timeout_secs=None,
        enable_rtvi=False,
    )

    async def push(pcm: bytes) -> None:
        await task.queue_frame(InputAudioRawFrame(audio=pcm, sample_rate=MIC_RATE, num_channels=1))

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(task)
    running = asyncio.create_task(runner.run())
    mic = Microphone(push, rate=MIC_RATE, idle_silence=True).start()
    try:
        await report.until("session", lambda: report.server_events["session.updated"])
        if args.scenario.endswith("turns"):
            await turns(client, mic, phrases)
        else:
            # How a Pipecat app starts (its examples all do): LLMRunFrame sets the conversation
            # up and asks for a first response, before the user says anything. Without it the
            # first tool result would set it up instead, replaying the context as a user text.
            await task.queue_frames([LLMRunFrame()])
            greeting = await client.reply("greeting", 0)
            report.step("greeting", **greeting.summary())
            check("greeting", greeting.status == "completed", f"greeting {greeting.status}")
            await tool(client, mic, phrases, calls)
        report.steps["interruption_frames"] = client.interruptions
    finally:
        await mic.stop()
        await task.queue_frame(EndFrame())
        try:
            await asyncio.wait_for(running, 15)
        except TimeoutError:
            await task.cancel()


async def turns(client: Client, mic: Microphone, phrases: dict[str, bytes]) -> None:
    report = client.report
    count = len(client.order)
    await mic.say(phrases["hello"])
    first = await client.reply("turn", count)
    report.step("turn", **first.summary())
    check("turn", first.status == "completed", f"reply ended {first.status}")
    check("turn", first.audio_samples > 0, "no audio in the reply")

    count = len(client.order)
    await mic.say(phrases["long"])
    second = await client.next_response("interrupt", count)
    await report.until("interrupt", lambda: second.audio_samples > 0 or second.done.is_set())
    count = len(client.order)
    truncated = report.server_events["conversation.item.truncated"]
    speaking = mic.saying(phrases["thanks"])
    await client.finished("interrupt", second)
    # Pipecat's own VAD interrupts on the user's speech: the server cancels the reply if it is
    # still sending it, and if it already sent all of it (a loaded machine: Pipecat's VAD
    # lags), the cancel is refused (`response_cancel_not_active`, as OpenAI's server does)
    # and Pipecat truncates the played item instead: both are the interruption
    if second.status == "completed":
        await report.until(
            "interrupt",
            lambda: report.server_events["conversation.item.truncated"] > truncated,
        )
    await speaking
    report.step(
        "interrupt",
        **second.summary(),
        truncated=report.server_events["conversation.item.truncated"] > truncated,
    )
    check(
        "interrupt",
        second.status == "cancelled"
        or report.server_events["conversation.item.truncated"] > truncated,
        f"interrupted reply ended {second.status}, not truncated",
    )

    third = await client.reply("next", count)
    report.step("next", **third.summary())
    check("next", third.status == "completed", f"reply ended {third.status}")
    check("next", third.audio_samples > 0, "no audio in the reply")


async def tool(
    client: Client, mic: Microphone, phrases: dict[str, bytes], calls: list[dict[str, Any]]
) -> None:
    report = client.report
    count = len(client.order)
    await mic.say(phrases["weather"])
    call_response = await client.reply("call", count)
    report.step("call", **call_response.summary())
    check("call", call_response.status == "completed", f"response ended {call_response.status}")
    await report.until("call", lambda: calls)
    check("call", [c["name"] for c in calls] == [TOOL_NAME], f"function calls: {calls}")
    # Pipecat sends the output and asks for the answer by itself
    answer = await client.reply("answer", client.order.index(call_response.id) + 1)
    report.step("answer", **answer.summary())
    check("answer", answer.status == "completed", f"answer ended {answer.status}")
    check("answer", answer.audio_samples > 0, "no audio in the answer")
    check("answer", "sunny" in answer.transcript.lower(), "the answer does not use the output")


def check(step: str, condition: bool, why: str) -> None:
    if not condition:
        raise StepFailed(step, why)


if __name__ == "__main__":
    run("pipecat", main)
