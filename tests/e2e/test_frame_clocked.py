"""A frame-clocked model end to end: real `duplex api` + `duplex worker --plugin
harness.frame_models:EchoFramePlugin` (the tick-batched stage on the real clock), and a
client on each surface: the duplex WebSocket, and the official openai SDK on plain GA."""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from harness.frame_models import RATE, tone
from harness.processes import start_api, start_worker
from harness.redis_server import free_port
from shared.client.duplex_client import DuplexClient
from shared.protocol.duplex import float_to_pcm16

PLUGIN = "harness.frame_models:EchoFramePlugin"
#: the checkout's root: `harness` is not installed with the package, so the worker finds
#: the test model through PYTHONPATH
CHECKOUT = str(Path(__file__).resolve().parents[2])
#: half a second of speech, then a second of quiet: the model says it back and stops
UTTERANCE = np.concatenate([tone(6), np.zeros(RATE, np.float32)])


@pytest.fixture(scope="module")
def frame_cluster(redis_server):
    prefix = f"duplex-frame-{uuid.uuid4().hex[:8]}"
    health = free_port()
    worker = start_worker(
        redis_server.url,
        prefix,
        "frame-worker",
        PLUGIN,
        DUPLEX_WORKER_HEALTH_PORT=str(health),
        PYTHONPATH=CHECKOUT,
    )
    api = start_api(redis_server.url, prefix, "frame-api")
    try:
        api.wait_ready()
        yield api, health
    finally:
        api.stop()
        worker.stop()


async def send_pcm(client: DuplexClient, samples: np.ndarray) -> None:
    pcm = float_to_pcm16(samples)
    step = RATE // 50 * 2  # 20 ms appends
    for start in range(0, len(pcm), step):
        await client.append_audio(pcm[start : start + step], format="pcm16", sample_rate_hz=RATE)


async def test_the_model_speaks_back_and_a_barge_in_cancels_it(frame_cluster):
    api, health = frame_cluster
    client = DuplexClient([api.base], heartbeat_s=None)
    await client.connect({})
    try:
        assert client.session["capabilities"]["implementation_level"] == "model_native_duplex"
        await send_pcm(client, UTTERANCE)
        events = await client.until("rate_limits.updated", timeout=30)
        kinds = [e.wire_type for e in events]
        assert "response.speak" in kinds and kinds[-2] == "response.done"
        assert events[-2].response["status"] == "completed"
        audio = b"".join(
            base64.b64decode(e.delta)
            for e in events
            if e.wire_type == "response.output_audio.delta"
        )
        assert len(audio) >= 2 * int(0.48 * RATE)  # at least the speaking frames, pcm16
        first_response = events[-2].response_id

        await send_pcm(client, tone(25))  # 2 s of speech: the model speaks over it
        await client.until("response.output_audio.delta", timeout=30)
        await client.send({"type": "barge_in"})
        done = (await client.until("response.done", timeout=30))[-1]
        assert done.response["status"] == "cancelled"
        await send_pcm(client, UTTERANCE)
        created = (await client.until("response.created", timeout=30))[-1]
        assert created.response_id not in (first_response, done.response_id)
        assert created.response["metadata"]["duplex_event"]["epoch"] >= 1
    finally:
        await client.close()
    metrics = httpx.get(f"http://127.0.0.1:{health}/metrics", timeout=5).text
    assert 'duplex_tick_slots{model="frame_echo"}' in metrics
    assert 'duplex_tick_duration_seconds_count{model="frame_echo"}' in metrics


async def test_the_openai_sdk_gets_the_model_speech_on_plain_ga(frame_cluster):
    api, _ = frame_cluster
    openai_client = AsyncOpenAI(api_key="unused", base_url=f"{api.base}/v1")
    pcm = float_to_pcm16(UTTERANCE)
    async with openai_client.realtime.connect(model="frame_echo") as connection:
        await connection.session.update(
            session={
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}},
            }
        )
        for start in range(0, len(pcm), 960):
            await connection.input_audio_buffer.append(
                audio=base64.b64encode(pcm[start : start + 960]).decode()
            )
        kinds, audio, transcript = [], b"", None
        async for event in connection:
            kinds.append(event.type)
            if event.type == "response.output_audio.delta":
                audio += base64.b64decode(event.delta)
            if event.type == "response.output_audio_transcript.done":
                transcript = event.transcript
            if event.type == "response.done":
                assert event.response.status == "completed"
                break
        await connection.response.create()  # the model decides when it speaks
        refusal = None
        async for event in connection:
            if event.type == "error":
                refusal = event.error.code
                break
    assert refusal == "unsupported_native_response_options"
    assert kinds[0] == "session.created" and "response.created" in kinds
    assert transcript and set(transcript) == {"."}
    assert len(audio) >= 2 * int(0.48 * RATE)
