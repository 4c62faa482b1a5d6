"""The Nemotron VoiceChat plugin end to end: redis-server, `duplex api` and `duplex worker`
as real processes of this venv, on the tiny random checkpoint (harness/tiny_nemotron.py).

The worker runs `tests.plugins.nemotron.scripted:ScriptedNemotronPlugin`: the real plugin and
frame model with the function channel scripted (the tiny model never calls a tool by
itself): a loud frame makes it call the session's first tool, and once the result has been
fed it says " sunny in paris". Everything else is the tiny model's own: it hears, speaks
(its random text is words on some frames) and its EAR-TTS voice comes back as audio.

Over the duplex surface (`DuplexClient` on `/v1/realtime?duplex=1`) and the official openai
SDK on plain `/v1/realtime` (GA): audio back, the tool call round trip, a barge-in or cancel
that ends a response; and a session whose worker is drained or killed goes on on another,
its model's memory (2,702-byte frame records) replayed. Every wait is for an event.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from harness.processes import start_api, start_worker, wait_worker_ready
from harness.redis_server import free_port
from shared.client.duplex_client import DuplexClient
from shared.protocol.duplex import float_to_pcm16
from tests.e2e.native_moves import move_a_native_session
from tests.plugins.nemotron.scripted import ANSWER

PLUGIN = "tests.plugins.nemotron.scripted:ScriptedNemotronPlugin"
CHECKOUT = str(Path(__file__).resolve().parents[3])  # the worker imports harness/
OPTIONS = "device=cpu,threads=1"
RATE = 24_000
FRAME = RATE * 80 // 1000
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
INSTRUCTIONS = "You are a helpful voice assistant."
WAIT_S = 90


def loud(frames: int = 1) -> np.ndarray:
    """A tone loud enough to make the scripted model call its tool (RMS 0.42)."""
    t = np.arange(frames * FRAME) / RATE
    return (0.6 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def speech(seed: int, frames: int) -> np.ndarray:
    """Quiet, speech-like input (under the scripted model's loudness)."""
    rng = np.random.default_rng(seed)
    t = np.arange(frames * FRAME) / RATE
    audio = 0.1 * np.sin(2 * np.pi * 200 * t) + 0.03 * rng.standard_normal(t.shape)
    return audio.astype(np.float32)


@pytest.fixture(scope="module")
def nemotron_cluster(redis_server, tiny_dir):
    prefix = f"duplex-nemotron-{uuid.uuid4().hex[:8]}"
    health = free_port()
    worker = start_worker(
        redis_server.url,
        prefix,
        "nemotron-worker",
        PLUGIN,
        DUPLEX_MODEL_DIR=str(tiny_dir),
        DUPLEX_PLUGIN_OPTIONS=OPTIONS,
        DUPLEX_MAX_SESSIONS="2",
        DUPLEX_WORKER_HEALTH_PORT=str(health),
        HF_HUB_OFFLINE="1",
        PYTHONPATH=CHECKOUT,
    )
    api = start_api(redis_server.url, prefix, "nemotron-api")
    try:
        wait_worker_ready(worker, health, 180)
        api.wait_ready()
        yield api, health
    finally:
        api.stop()
        worker.stop()


async def send_pcm(client: DuplexClient, samples: np.ndarray) -> None:
    pcm = float_to_pcm16(samples)
    step = FRAME * 2  # 80 ms appends
    for start in range(0, len(pcm), step):
        await client.append_audio(pcm[start : start + step], format="pcm16", sample_rate_hz=RATE)


async def until_done(client: DuplexClient, matches) -> tuple[Any, list[Any]]:
    """Responses until one whose response.done `matches` (the tiny model also speaks on its
    own: its other responses are skipped); returns that done and every event up to it."""
    deadline = time.monotonic() + WAIT_S
    seen: list[Any] = []
    while time.monotonic() < deadline:
        events = await client.until("response.done", timeout=WAIT_S)
        seen += events
        if matches(events[-1]):
            return events[-1], seen
    raise AssertionError("no matching response")


def function_calls(done: Any) -> list[dict]:
    return [i for i in done.response.get("output", []) if i.get("type") == "function_call"]


def transcript(done: Any) -> str:
    parts = [
        c.get("transcript") or ""
        for item in done.response.get("output", [])
        for c in item.get("content", []) or []
    ]
    return "".join(parts)


async def test_duplex_surface_audio_a_tool_round_trip_and_a_barge_in(nemotron_cluster):
    api, health = nemotron_cluster
    client = DuplexClient([api.base], heartbeat_s=None)
    await client.connect({"tools": [WEATHER], "instructions": INSTRUCTIONS})
    try:
        assert client.session["capabilities"]["implementation_level"] == "model_native_duplex"
        await send_pcm(client, speech(1, 25))
        events = await client.until("response.output_audio.delta", timeout=WAIT_S)
        assert len(base64.b64decode(events[-1].delta)) > 0  # its voice, resampled to 24 kHz

        await send_pcm(client, np.concatenate([loud(), speech(2, 4)]))
        done, seen = await until_done(client, lambda d: function_calls(d))
        (call,) = function_calls(done)
        assert call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == {"city": "Paris"}
        kinds = [e.wire_type for e in seen]
        assert "response.function_call_arguments.done" in kinds
        # the call's text never reaches the transcript
        assert "TOOLCALL" not in json.dumps(done.response)

        output = {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"}
        await client.send({"type": "conversation.item.create", "item": output})
        answer, _ = await until_done(client, lambda d: ANSWER.strip() in transcript(d))
        assert answer.response["status"] == "completed"

        # a barge-in ends the response in progress (the model keeps its memory)
        await send_pcm(client, speech(3, 4))
        created = (await client.until("response.created", timeout=WAIT_S))[-1]
        await client.send({"type": "barge_in"})
        done, _ = await until_done(client, lambda d: d.response_id == created.response_id)
        assert done.response["status"] == "cancelled"
        await send_pcm(client, speech(4, 12))
        again = (await client.until("response.created", timeout=WAIT_S))[-1]
        assert again.response_id != created.response_id
    finally:
        await client.close()
    metrics = httpx.get(f"http://127.0.0.1:{health}/metrics", timeout=5).text
    assert 'duplex_tick_duration_seconds_count{model="nemotron"}' in metrics


async def test_a_session_refuses_what_nemotron_does_not_take(nemotron_cluster):
    api, _ = nemotron_cluster
    client = DuplexClient([api.base], heartbeat_s=None)
    with pytest.raises(Exception, match="unsupported_nemotron_duplex_mode"):
        await client.connect({"extra_body": {"auto_response": False}})
    client = DuplexClient([api.base], heartbeat_s=None)
    await client.connect({"tools": [WEATHER], "instructions": INSTRUCTIONS})
    try:
        await client.send({"type": "session.update", "session": {"instructions": "other"}})
        error = (await client.until("error", timeout=WAIT_S))[-1]
        assert error.code == "instructions_update_unsupported"
    finally:
        await client.close()


async def test_openai_sdk_audio_and_a_tool_round_trip(nemotron_cluster):
    api, _ = nemotron_cluster
    openai_client = AsyncOpenAI(api_key="unused", base_url=f"{api.base}/v1")
    # autostart off: the first session.update opens the session, with its tools and
    # instructions (fixed from then on: the model's prompt)
    async with openai_client.realtime.connect(
        model="nemotron", extra_query={"autostart": "false"}
    ) as connection:
        await connection.session.update(
            session={
                "type": "realtime",
                "instructions": INSTRUCTIONS,
                "output_modalities": ["audio"],
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE}}},
                "tools": [WEATHER],
            }
        )

        async def say(samples: np.ndarray) -> None:
            """As a microphone does: 80 ms a chunk, in real time (the pacing is the
            microphone's, not an ordering of events). A burst sent while the slot still
            runs its prompt would be cut to its newest frames, as after a restore."""
            pcm = float_to_pcm16(samples)
            for start in range(0, len(pcm), FRAME * 2):
                await connection.input_audio_buffer.append(
                    audio=base64.b64encode(pcm[start : start + FRAME * 2]).decode()
                )
                await asyncio.sleep(0.08)

        async def response_where(matches) -> Any:
            deadline = time.monotonic() + WAIT_S
            async for event in connection:
                assert event.type != "error", event
                if event.type == "response.done" and matches(event.response):
                    return event.response
                assert time.monotonic() < deadline, "no matching response"
            raise AssertionError("the connection ended")

        await say(speech(5, 12))
        await say(np.concatenate([loud(), speech(6, 4)]))
        done = await response_where(lambda r: any(i.type == "function_call" for i in r.output))
        (call,) = [i for i in done.output if i.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        await connection.conversation.item.create(
            item={"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}
        )

        def says_the_answer(response: Any) -> bool:
            text = "".join(
                getattr(c, "transcript", None) or ""
                for item in response.output
                for c in (getattr(item, "content", None) or [])
            )
            return ANSWER.strip() in text

        answer = await response_where(says_the_answer)
        assert answer.status == "completed"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["drain", "failover"])
async def test_a_nemotron_session_keeps_its_models_memory_when_its_worker_goes(
    redis_server, tiny_dir, how
):
    written, frames = await move_a_native_session(
        redis_server.url,
        how,
        plugin=PLUGIN,
        model="nemotron",
        record_bytes=2702,
        load_s=240,  # two workers importing NeMo and loading at once on a loaded CI machine
        DUPLEX_MODEL_DIR=str(tiny_dir),
        DUPLEX_PLUGIN_OPTIONS=OPTIONS,
        DUPLEX_MAX_SESSIONS="2",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=CHECKOUT,
    )
    assert frames >= 25 and len(written) > frames * 2702
