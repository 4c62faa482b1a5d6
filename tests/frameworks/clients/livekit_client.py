"""LiveKit Agents as a client of duplex serve: `livekit-plugins-openai`'s RealtimeModel and its
RealtimeSession, without a LiveKit server (audio frames are pushed to the session and read
from its generations, as AgentSession does with a room's tracks).

    .venv-frameworks/bin/python tests/frameworks/clients/livekit_client.py \
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
from livekit import rtc
from livekit.agents import llm
from livekit.plugins import openai


class Client:
    def __init__(self, session: Any, report: Report) -> None:
        self.session = session
        self.report = report
        self.responses: dict[str, Response] = {}
        self.order: list[str] = []
        #: per response, the task reading the framework's streams of its generation
        self.readers: dict[str, asyncio.Task[None]] = {}
        session.on("openai_server_event_received", self._server_event)
        session.on("openai_client_event_queued", self._client_event)
        session.on("generation_created", self._generation)
        session.on("input_audio_transcription_completed", self._transcript)
        session.on("error", self._error)

    def _server_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "response.created":
            response_id = event["response"]["id"]
            self.responses.setdefault(response_id, Response(response_id))
            self.order.append(response_id)
        elif kind == "response.done":
            body = event["response"]
            response = self.responses.setdefault(body["id"], Response(body["id"]))
            response.status = body.get("status")
            response.reason = (body.get("status_details") or {}).get("reason")
            response.done.set()
        self.report.server_event(event)

    def _client_event(self, event: dict[str, Any]) -> None:
        self.report.client_event(str(event.get("type")))

    def _transcript(self, event: Any) -> None:
        if event.is_final:
            self.report.user_transcripts.append(event.transcript)
            self.report.notify()

    def _error(self, event: Any) -> None:
        self.report.errors.append(f"framework error event: {event.error!r}")
        self.report.notify()

    def _generation(self, event: llm.GenerationCreatedEvent) -> None:
        response = self.responses.setdefault(event.response_id, Response(event.response_id))
        task = asyncio.get_running_loop().create_task(self._read_generation(event, response))
        task.add_done_callback(lambda _: self.report.notify())
        self.readers[response.id] = task

    async def _read_generation(self, event: llm.GenerationCreatedEvent, response: Response):
        readers = []
        async for message in event.message_stream:
            readers.append(asyncio.create_task(self._read_audio(message.audio_stream, response)))
            readers.append(asyncio.create_task(self._read_text(message.text_stream, response)))
        async for call in event.function_stream:
            response.function_calls.append(
                {"name": call.name, "call_id": call.call_id, "arguments": call.arguments}
            )
            self.report.notify()
        await asyncio.gather(*readers)

    async def _read_audio(self, stream: Any, response: Response) -> None:
        async for frame in stream:
            response.audio_samples += frame.samples_per_channel
            self.report.notify()

    async def _read_text(self, stream: Any, response: Response) -> None:
        async for text in stream:
            response.transcript += text
            self.report.notify()

    def push(self, pcm: bytes) -> None:
        frame = rtc.AudioFrame(
            data=pcm, sample_rate=RATE, num_channels=1, samples_per_channel=len(pcm) // 2
        )
        self.session.push_audio(frame)

    def after(self, count: int) -> Response | None:
        """The first response created after the first `count` ones."""
        return self.responses[self.order[count]] if len(self.order) > count else None

    async def next_response(self, step: str, count: int) -> Response:
        return await self.report.until(step, lambda: self.after(count))

    async def finished(self, step: str, response: Response) -> Response:
        await self.report.until(step, lambda: response.done.is_set())
        # the framework's streams close on response.done: let its reader drain them
        reader = self.readers.get(response.id)
        if reader is not None:
            await self.report.until(step, reader.done)
        return response

    async def reply(self, step: str, count: int) -> Response:
        return await self.finished(step, await self.next_response(step, count))


def check(step: str, condition: bool, why: str) -> None:
    if not condition:
        raise StepFailed(step, why)


async def main(args: Any, report: Report) -> None:
    phrases = speech(args)
    manual = args.scenario.startswith("manual")
    options: dict[str, Any] = {"turn_detection": None} if manual else {}
    model = openai.realtime.RealtimeModel(
        model=args.model, base_url=f"{args.url}/v1", api_key="unused", **options
    )
    session = model.session()
    client = Client(session, report)
    mic = Microphone(client.push, idle_silence=not manual).start()
    try:
        await report.until("session", lambda: report.server_events["session.updated"])
        if args.scenario.endswith("turns"):
            await turns(client, mic, phrases, manual)
        else:
            await tool(client, mic, phrases, manual)
    finally:
        await mic.stop()
        await session.aclose()
        await model.aclose()


async def user_turn(client: Client, mic: Microphone, pcm: bytes, manual: bool) -> int:
    """Say `pcm`; in manual mode commit it and ask for a reply. Returns how many responses
    existed before, so `client.reply(step, count)` finds the one this turn gets."""
    count = len(client.order)
    await mic.say(pcm)
    if manual:
        client.session.commit_audio()
        await client.session.generate_reply()
    return count


async def turns(client: Client, mic: Microphone, phrases: dict[str, bytes], manual: bool):
    report = client.report
    # a voice turn gets a spoken reply
    first = await client.reply("turn", await user_turn(client, mic, phrases["hello"], manual))
    report.step("turn", **first.summary())
    check("turn", first.status == "completed", f"reply ended {first.status}")
    check("turn", first.audio_samples > 0, "no audio in the reply")

    # the user interrupts the next reply once it speaks
    count = await user_turn(client, mic, phrases["long"], manual)
    second = await client.next_response("interrupt", count)
    await report.until("interrupt", lambda: second.audio_samples > 0 or second.done.is_set())
    heard_ms = second.audio_samples * 1000 // RATE
    if manual:
        client.session.interrupt()
        # what AgentSession does with what was played: truncate the item there
        await report.until("interrupt", lambda: second.done.is_set())
        await truncate(client, second, heard_ms)
        third_pcm = phrases["thanks"]
        count = await user_turn(client, mic, third_pcm, manual)
    else:
        count = len(client.order)
        speaking = mic.saying(phrases["thanks"])
        await client.finished("interrupt", second)
        await truncate(client, second, heard_ms)
        await speaking
    await client.finished("interrupt", second)
    report.step("interrupt", **second.summary())
    check("interrupt", second.status == "cancelled", f"interrupted reply ended {second.status}")

    # the next turn works
    third = await client.reply("next", count)
    report.step("next", **third.summary())
    check("next", third.status == "completed", f"reply ended {third.status}")
    check("next", third.audio_samples > 0, "no audio in the reply")


async def truncate(client: Client, response: Response, heard_ms: int) -> None:
    items = [m for m in client.session.chat_ctx.items if m.type == "message"]
    if items and items[-1].role == "assistant":
        client.session.truncate(
            message_id=items[-1].id, modalities=["audio", "text"], audio_end_ms=heard_ms
        )


async def get_weather() -> str:
    return TOOL_OUTPUT


async def tool(client: Client, mic: Microphone, phrases: dict[str, bytes], manual: bool):
    report = client.report
    session = client.session
    weather = llm.function_tool(get_weather, name=TOOL_NAME, description=TOOL_DESCRIPTION)
    await session.update_tools([weather])
    await report.until("tools", lambda: report.server_events["session.updated"] >= 2)

    call_response = await client.reply(
        "call", await user_turn(client, mic, phrases["weather"], manual)
    )
    report.step("call", **call_response.summary())
    calls = call_response.function_calls
    check("call", call_response.status == "completed", f"response ended {call_response.status}")
    check("call", [c["name"] for c in calls] == [TOOL_NAME], f"function calls: {calls}")
    json.loads(calls[0]["arguments"] or "{}")

    # what AgentSession does after running the tool: the output into the chat context, then
    # a reply (function calls never get an automatic reply from the Realtime API)
    chat_ctx = session.chat_ctx.copy()
    chat_ctx.items.append(
        llm.FunctionCallOutput(
            call_id=calls[0]["call_id"],
            name=TOOL_NAME,
            output=await get_weather(),
            is_error=False,
        )
    )
    await session.update_chat_ctx(chat_ctx)
    count = len(client.order)
    await session.generate_reply()
    answer = await client.reply("answer", count)
    report.step("answer", **answer.summary())
    check("answer", answer.status == "completed", f"answer ended {answer.status}")
    check("answer", answer.audio_samples > 0, "no audio in the answer")
    check("answer", "sunny" in answer.transcript.lower(), "the answer does not use the output")


if __name__ == "__main__":
    run("livekit", main)
