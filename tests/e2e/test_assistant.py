"""The assistant through the whole server: `duplex serve --plugin assistant`, a client
speaking synthesized speech in real time, a spoken answer, and a barge-in."""

import asyncio

import pytest

from harness.processes import start_serve
from harness.speech import ASSISTANT_SESSION, say, spoken
from shared.client.duplex_client import DuplexClient


@pytest.fixture(scope="module")
def assistant():
    process = start_serve("serve-assistant", ("--plugin", "assistant"))
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


async def test_hello_is_heard_answered_aloud_and_barged_into(assistant):
    client = await DuplexClient(assistant.base, heartbeat_s=None).connect(ASSISTANT_SESSION)
    try:
        await say(client, spoken("hello"))
        heard = (await client.until("conversation.item.input_audio_transcription.completed"))[-1]
        assert "hello" in heard.transcript
        events = await client.until("response.output_audio.delta")
        response_id = events[-1].response_id
        events += await client.until("response.output_audio_transcript.delta")
        assert any(
            e.wire_type == "response.output_audio_transcript.delta" and e.delta for e in events
        )

        # the user speaks while the assistant is still talking: barge-in
        speaking = asyncio.create_task(say(client, spoken("thank you", lead_s=0.1)))
        events = await client.until("response.done", timeout=30)
        await speaking
        done = events[-1]
        assert done.response_id == response_id
        assert done.response["status"] == "cancelled"
        assert done.response["status_details"]["reason"] == "barge_in"
        # ack_only: what was played (nothing acknowledged here) is what history keeps
        assert any(e.wire_type == "input_audio_buffer.speech_started" for e in events)
    finally:
        await client.close()


async def test_chat_completions_use_the_built_in_responder(assistant):
    import httpx

    async with httpx.AsyncClient(base_url=assistant.base) as http:
        reply = await http.post(
            "/v1/chat/completions",
            json={"model": "assistant", "messages": [{"role": "user", "content": "hello"}]},
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "Hello! How can I help you?"


async def test_a_worker_pod_serves_the_assistant(redis_server):
    """`duplex worker --plugin assistant` behind `duplex api` on a real Redis."""
    import uuid

    from harness.processes import start_api, start_worker

    prefix = f"duplex-test-{uuid.uuid4().hex[:8]}"
    worker = start_worker(redis_server.url, prefix, "assistant-worker", plugin="assistant")
    api = start_api(redis_server.url, prefix, "assistant-api")
    try:
        api.wait_ready()
        client = await DuplexClient(api.base, heartbeat_s=None).connect(
            {"turn_detection": None, "extra_body": {"pace": 0}}
        )
        assert client.session["capabilities"]["supports_barge_in"]
        await client.send({"type": "input.text.append", "text": "what is your name"})
        await client.send({"type": "input.commit"})
        events = await client.until("response.done", timeout=30)
        said = next(e for e in events if e.wire_type == "response.output_audio_transcript.done")
        assert said.transcript == "I am the duplex serve assistant."
        assert any(e.wire_type == "response.output_audio.delta" for e in events)
        await client.close()
    finally:
        api.stop()
        worker.stop()
