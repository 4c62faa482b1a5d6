"""Tool calls of a model-native (frame-clocked) model end to end: real `duplex api` + `duplex
worker --plugin harness.frame_models:ToolEchoFramePlugin` on redis-server, over the duplex
WebSocket (`DuplexClient`) and the official openai SDK on plain `/v1/realtime` (GA).

The test model calls the session's first tool at the first loud frame it hears: after a low
tone its response ends once the input is quiet, and the call arrives as a function_call
item; after a high tone it holds its response (and the call) until it is interrupted, so a
barge-in or cancel drops the call. The client's function_call_output goes to the model,
which then speaks the output on its own (a new response with audio). Every wait is for an
event the client sees.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from openai import AsyncOpenAI

from harness.frame_models import FRAME_SAMPLES, RATE, tone
from harness.processes import start_api, start_worker
from shared.client.duplex_client import DuplexClient
from shared.protocol.duplex import float_to_pcm16
from shared.redis.keys import KeySchema

PLUGIN = "harness.frame_models:ToolEchoFramePlugin"
CHECKOUT = str(Path(__file__).resolve().parents[2])
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
#: whole frames of quiet (every sound here is whole frames: the model hears each as sent)
QUIET = np.zeros(6 * FRAME_SAMPLES, np.float32)
#: a low tone, then quiet: the model calls get_weather and its response completes
ASK = np.concatenate([tone(3), QUIET])
#: one frame of a high tone, then quiet: the model calls get_weather and holds its response
#: until it is interrupted
HOLD = np.concatenate([tone(1, freq_hz=880), QUIET])
CALL_EVENTS = [
    "response.output_item.added",
    "conversation.item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "conversation.item.done",
]
WAIT_S = 30


@pytest.fixture(scope="module")
def tool_cluster(redis_server):
    prefix = f"duplex-tools-{uuid.uuid4().hex[:8]}"
    worker = start_worker(redis_server.url, prefix, "tool-worker", PLUGIN, PYTHONPATH=CHECKOUT)
    api = start_api(redis_server.url, prefix, "tool-api")
    registry = redis.Redis.from_url(redis_server.url)
    try:
        api.wait_ready()
        deadline = time.monotonic() + 60  # the worker registered (polled): it takes the open
        while registry.zcard(KeySchema(prefix).workers()) < 1:
            assert time.monotonic() < deadline, "the worker did not register"
            time.sleep(0.05)
        yield api
    finally:
        api.stop()
        worker.stop()
        registry.close()


def calls_of(events: list[Any]) -> list[str]:
    """The function-call item event types among `events`, in order."""
    kinds = []
    for event in events:
        kind = event.wire_type if hasattr(event, "wire_type") else event.type
        item = getattr(event, "item", None)
        item_type = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
        if "function_call" in kind or item_type == "function_call":
            kinds.append(kind)
    return kinds


# ---------------------------------------------------------------- the duplex surface


async def send_pcm(client: DuplexClient, samples: np.ndarray) -> None:
    pcm = float_to_pcm16(samples)
    step = RATE // 50 * 2  # 20 ms appends
    for start in range(0, len(pcm), step):
        await client.append_audio(pcm[start : start + step], format="pcm16", sample_rate_hz=RATE)


async def test_duplex_surface_a_call_its_output_and_the_models_answer(tool_cluster):
    client = DuplexClient([tool_cluster.base], heartbeat_s=None)
    await client.connect({"tools": [WEATHER]})
    try:
        await send_pcm(client, ASK)
        events = await client.until("response.done", timeout=WAIT_S)
        done = events[-1]
        assert done.response["status"] == "completed"
        assert [k for k in calls_of(events) if k != "conversation.item.created"] == CALL_EVENTS
        (call,) = [i for i in done.response["output"] if i["type"] == "function_call"]
        assert call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"band": "low", "call": 1}
        arguments = next(
            e for e in events if e.wire_type == "response.function_call_arguments.done"
        )
        assert (arguments.call_id, arguments.name) == (call["call_id"], "get_weather")

        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
        await client.send({"type": "conversation.item.create", "item": output})
        answer = await client.until("response.done", timeout=WAIT_S)
        assert answer[-1].response["status"] == "completed"
        assert answer[-1].response_id != done.response_id
        assert any(e.wire_type == "response.output_audio.delta" for e in answer)
        transcript = next(
            e for e in answer if e.wire_type == "response.output_audio_transcript.done"
        )
        assert transcript.transcript == "sunny"
        assert not calls_of(answer)
        await client.send({"type": "response.create"})  # still the model's to decide
        assert (await client.until("error", timeout=WAIT_S))[-1].code == (
            "unsupported_native_response_options"
        )
    finally:
        await client.close()


async def test_duplex_surface_a_barge_in_drops_a_held_call(tool_cluster):
    client = DuplexClient([tool_cluster.base], heartbeat_s=None)
    await client.connect({"tools": [WEATHER]})
    try:
        await send_pcm(client, HOLD)
        await client.until("response.created", timeout=WAIT_S)  # opened by the call's frame
        await client.send({"type": "barge_in"})
        events = await client.until("response.done", timeout=WAIT_S)
        assert events[-1].response["status"] == "cancelled"
        assert not calls_of(events)
        assert not [i for i in events[-1].response["output"] if i["type"] == "function_call"]
        # the model goes on: its next call (its second) is the one the client gets
        await send_pcm(client, ASK)
        events = await client.until("response.done", timeout=WAIT_S)
        (call,) = [i for i in events[-1].response["output"] if i["type"] == "function_call"]
        assert json.loads(call["arguments"]) == {"band": "low", "call": 2}
        assert [k for k in calls_of(events) if k != "conversation.item.created"] == CALL_EVENTS
    finally:
        await client.close()


# ---------------------------------------------------------------- the openai SDK (GA)


async def next_response(connection, kinds: list[str]) -> list[Any]:
    """The events up to the next response.done (their types appended to `kinds`)."""
    events = []
    async for event in connection:
        events.append(event)
        kinds.append(event.type)
        assert event.type != "error", event
        if event.type == "response.done":
            return events
    raise AssertionError("the connection ended")


async def test_openai_sdk_a_call_its_output_the_answer_and_a_cancel_that_drops_one(tool_cluster):
    openai_client = AsyncOpenAI(api_key="unused", base_url=f"{tool_cluster.base}/v1")
    # autostart off: the first session.update opens the session, so the model's slot opens
    # with the tools (a FrameModel gets its options at the open)
    async with openai_client.realtime.connect(
        model="frame_tool_echo", extra_query={"autostart": "false"}
    ) as connection:
        await connection.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}},
                "tools": [WEATHER],
            }
        )

        async def say(samples: np.ndarray) -> None:
            pcm = float_to_pcm16(samples)
            for start in range(0, len(pcm), 960):
                chunk = base64.b64encode(pcm[start : start + 960]).decode()
                await connection.input_audio_buffer.append(audio=chunk)

        kinds: list[str] = []
        await say(ASK)
        events = await next_response(connection, kinds)
        done = events[-1].response
        assert done.status == "completed"
        (call,) = done.output  # GA: a response that only calls a tool has no message item
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"band": "low", "call": 1}
        assert [k for k in calls_of(events) if k != "conversation.item.created"] == CALL_EVENTS
        added = next(e for e in events if e.type == "response.output_item.added")
        assert added.output_index == 0 and added.item.type == "function_call"
        arguments = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert arguments.call_id == call.call_id and arguments.arguments == call.arguments

        await connection.conversation.item.create(
            item={"type": "function_call_output", "call_id": call.call_id, "output": "rain"}
        )
        answer = await next_response(connection, kinds)
        assert answer[-1].response.status == "completed"
        assert any(e.type == "response.output_audio.delta" for e in answer)
        transcript = next(e for e in answer if e.type == "response.output_audio_transcript.done")
        assert transcript.transcript == "rain"
        assert not calls_of(answer)

        await say(HOLD)
        async for event in connection:  # the call's frame opens a response
            assert event.type != "error", event
            if event.type == "response.created":
                break
        await connection.response.cancel()
        cancelled = await next_response(connection, kinds)
        assert cancelled[-1].response.status == "cancelled"
        assert cancelled[-1].response.output == []
        assert not calls_of(cancelled)
