"""The OpenAI Agents SDK as a client of duplex serve: a RealtimeAgent run by a RealtimeRunner
whose model config points `url` at duplex serve. Audio goes in with `session.send_audio`, comes
out as the session's `audio` events; tools run in the SDK's own loop.

    .venv-frameworks/bin/python tests/frameworks/clients/agents_client.py \
        --url http://127.0.0.1:8000 --scenario defaults_turns --speech hello=hello.wav ...
"""

from __future__ import annotations

import asyncio
import json
import os
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

# the SDK logs the server events it cannot validate only with this (the findings need them)
os.environ.setdefault("OPENAI_AGENTS_DONT_LOG_MODEL_DATA", "0")

from agents import function_tool, set_tracing_disabled
from agents.realtime import RealtimeAgent, RealtimeRunner
from agents.realtime.model_inputs import RealtimeModelSendRawMessage


@function_tool(name_override=TOOL_NAME, description_override=TOOL_DESCRIPTION)
async def get_weather() -> str:
    return TOOL_OUTPUT


class Client:
    def __init__(self, session: Any, report: Report) -> None:
        self.session = session
        self.report = report
        self.responses: dict[str, Response] = {}
        self.order: list[str] = []
        self.tool_ends: list[dict[str, Any]] = []
        #: the function_call items the server sent, by response (the SDK then runs the tool)
        self.server_calls: dict[str, list[str]] = {}
        self.task = asyncio.get_running_loop().create_task(self._events())
        self.task.add_done_callback(lambda _: report.notify())

    async def _events(self) -> None:
        async for event in self.session:
            self.report.client_event(f"session:{event.type}")
            if event.type == "raw_model_event":
                data = event.data
                if data.type == "raw_server_event":
                    self._server_event(data.data)
                elif data.type in ("error", "exception"):
                    detail = getattr(data, "error", None) or getattr(data, "exception", None)
                    self.report.errors.append(f"model {data.type}: {short(detail)}")
            elif event.type == "audio":
                response = self._response(event.audio.response_id)
                response.audio_samples += len(event.audio.data) // 2
            elif event.type == "tool_start":
                self._current_calls().append(
                    {"name": event.tool.name, "arguments": event.arguments}
                )
            elif event.type == "tool_end":
                self.tool_ends.append({"name": event.tool.name, "output": str(event.output)})
            elif event.type == "error":
                self.report.errors.append(f"session error: {short(event.error)}")
            self.report.notify()

    def _current_calls(self) -> list[dict[str, str]]:
        return self.responses[self.order[-1]].function_calls if self.order else []

    def _response(self, response_id: str) -> Response:
        return self.responses.setdefault(response_id, Response(response_id))

    def _server_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "response.created":
            self._response(event["response"]["id"])
            self.order.append(event["response"]["id"])
        elif kind == "response.output_audio_transcript.delta":
            self._response(event["response_id"]).transcript += event.get("delta", "")
        elif kind == "conversation.item.input_audio_transcription.completed":
            self.report.user_transcripts.append(event.get("transcript", ""))
        elif kind == "response.output_item.done" and event["item"].get("type") == "function_call":
            self.server_calls.setdefault(event["response_id"], []).append(event["item"]["name"])
        elif kind == "response.done":
            body = event["response"]
            response = self._response(body["id"])
            response.status = body.get("status")
            response.reason = (body.get("status_details") or {}).get("reason")
            response.done.set()
        self.report.server_event(event)

    async def push(self, pcm: bytes) -> None:
        await self.session.send_audio(pcm)
        self.report.client_event("send_audio")

    def after(self, count: int) -> Response | None:
        return self.responses[self.order[count]] if len(self.order) > count else None

    async def next_response(self, step: str, count: int) -> Response:
        return await self.report.until(step, lambda: self.after(count))

    async def finished(self, step: str, response: Response) -> Response:
        await self.report.until(step, lambda: response.done.is_set())
        return response

    async def reply(self, step: str, count: int) -> Response:
        return await self.finished(step, await self.next_response(step, count))

    async def create_response(self) -> None:
        """What the SDK's docs give for turns the client ends: a raw `response.create`."""
        await self.session.model.send_event(
            RealtimeModelSendRawMessage(message={"type": "response.create"})
        )


def short(error: Any) -> str:
    """A pydantic ValidationError as its locations and messages, anything else as repr."""
    if hasattr(error, "errors") and callable(error.errors):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()[:4])[
            :500
        ]
    return repr(error)[:500]


def check(step: str, condition: bool, why: str) -> None:
    if not condition:
        raise StepFailed(step, why)


async def main(args: Any, report: Report) -> None:
    set_tracing_disabled(True)  # traces would go to api.openai.com
    phrases = speech(args)
    manual = args.scenario.startswith("manual")
    tools = [get_weather] if args.scenario.endswith("tool") else []
    agent = RealtimeAgent(
        name="assistant", instructions="You are a helpful assistant.", tools=tools
    )
    settings: dict[str, Any] = {"model_name": args.model}
    if manual:
        settings["turn_detection"] = None
    runner = RealtimeRunner(agent, config={"model_settings": settings})
    ws_url = args.url.replace("http", "ws", 1)
    session = await runner.run(
        model_config={"url": f"{ws_url}/v1/realtime?model={args.model}", "api_key": "unused"}
    )
    async with session:
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
    client.task.cancel()


async def user_turn(client: Client, mic: Microphone, pcm: bytes, manual: bool) -> int:
    count = len(client.order)
    await mic.say(pcm)
    if manual:
        await client.session.send_audio(b"", commit=True)
        await client.create_response()
    return count


async def turns(client: Client, mic: Microphone, phrases: dict[str, bytes], manual: bool):
    report = client.report
    first = await client.reply("turn", await user_turn(client, mic, phrases["hello"], manual))
    report.step("turn", **first.summary())
    check("turn", first.status == "completed", f"reply ended {first.status}")
    check("turn", first.audio_samples > 0, "no audio in the reply")

    count = await user_turn(client, mic, phrases["long"], manual)
    second = await client.next_response("interrupt", count)
    await report.until("interrupt", lambda: second.audio_samples > 0 or second.done.is_set())
    if manual:
        await client.session.interrupt()
        await client.finished("interrupt", second)
        count = await user_turn(client, mic, phrases["thanks"], manual)
    else:
        count = len(client.order)
        speaking = mic.saying(phrases["thanks"])
        await client.finished("interrupt", second)
        await speaking
    report.step("interrupt", **second.summary(), heard_ms=second.audio_samples * 1000 // RATE)
    check("interrupt", second.status == "cancelled", f"interrupted reply ended {second.status}")

    third = await client.reply("next", count)
    report.step("next", **third.summary())
    check("next", third.status == "completed", f"reply ended {third.status}")
    check("next", third.audio_samples > 0, "no audio in the reply")


async def tool(client: Client, mic: Microphone, phrases: dict[str, bytes], manual: bool):
    report = client.report
    call_response = await client.reply(
        "call", await user_turn(client, mic, phrases["weather"], manual)
    )
    if client.server_calls.get(call_response.id):  # the SDK runs the tool on its own task
        await report.until("call", lambda: client.tool_ends)
    calls = call_response.function_calls
    report.step("call", **call_response.summary(), tool_ends=client.tool_ends)
    check("call", call_response.status == "completed", f"response ended {call_response.status}")
    check("call", [c["name"] for c in calls] == [TOOL_NAME], f"function calls: {calls}")
    json.loads(calls[0]["arguments"] or "{}")
    check("call", [t["output"] for t in client.tool_ends] == [TOOL_OUTPUT], "the tool did not run")
    # the SDK sends the tool's output and asks for the answer by itself
    answer = await client.reply("answer", client.order.index(call_response.id) + 1)
    report.step("answer", **answer.summary())
    check("answer", answer.status == "completed", f"answer ended {answer.status}")
    check("answer", answer.audio_samples > 0, "no audio in the answer")
    check("answer", "sunny" in answer.transcript.lower(), "the answer does not use the output")


if __name__ == "__main__":
    run("agents", main)
