"""Plain /v1/realtime is OpenAI's Realtime GA API, through real processes and the official
`openai` SDK with GA's defaults: every event a client receives is a GA server event and
validates strictly against the SDK's own types (tests/protocol/ga_events.py), with no key
GA does not declare."""

import base64

import numpy as np
import pytest
from openai import AsyncOpenAI

from harness.sessions import speech_wav
from shared.protocol.duplex import StreamingResampler, float_to_pcm16
from tests.protocol.ga_events import receive_until

#: a bound on each wait, so a missing event fails the test instead of hanging it
WAIT_S = 30


@pytest.fixture
def openai_client(serve):
    return AsyncOpenAI(api_key="unused", base_url=f"{serve.base}/v1")


@pytest.fixture(scope="module")
def speech() -> bytes:
    """'Hello there, can you hear me?' as GA's audio: pcm16 at 24 kHz, then 1 s of silence
    (the server VAD ends the turn after 500 ms of it)."""
    audio, rate = speech_wav()
    resampler = StreamingResampler(rate, 24000)
    samples = np.concatenate([resampler.process(audio), resampler.flush()])
    return float_to_pcm16(np.concatenate([samples, np.zeros(24000, np.float32)]))


async def say(connection, pcm: bytes) -> None:
    """Appends of 20 ms; the server VAD keeps time by samples, so they need no pacing."""
    for start in range(0, len(pcm), 960):
        chunk = base64.b64encode(pcm[start : start + 960]).decode()
        await connection.input_audio_buffer.append(audio=chunk)


async def until(connection, wire_type: str, seen: list[dict]) -> dict:
    return await receive_until(connection, wire_type, seen, WAIT_S)


def types(events: list[dict]) -> list[str]:
    return [event["type"] for event in events]


async def test_ga_defaults_and_a_turn_ended_by_server_vad(openai_client, speech):
    seen: list[dict] = []
    async with openai_client.realtime.connect(model="echo") as connection:
        created = await until(connection, "session.created", seen)
        audio = created["session"]["audio"]
        assert audio["input"]["format"] == audio["output"]["format"]
        assert audio["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
        assert audio["input"]["turn_detection"]["type"] == "server_vad"
        await say(connection, speech)  # no commit, no response.create: the VAD ends the turn
        done = await until(connection, "response.done", seen)
    kinds = types(seen)
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index(
        "input_audio_buffer.speech_stopped"
    )
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    assert done["response"]["status"] == "completed" and done["response"]["metadata"] is None
    assert kinds.count("response.output_audio.delta") > 0
    assert kinds[0] == "session.created" and "session.updated" not in kinds


async def test_a_barge_in_cancels_with_turn_detected(openai_client, speech):
    seen: list[dict] = []
    async with openai_client.realtime.connect(model="echo") as connection:
        await until(connection, "session.created", seen)
        await say(connection, speech)
        first = await until(connection, "response.output_audio.delta", seen)
        await say(connection, speech)  # the user speaks over the (real-time) reply
        done = await until(connection, "response.done", seen)
    assert done["response"]["id"] == first["response_id"]
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}


async def test_manual_turns_echo_metadata_and_send_no_speech_events(openai_client, speech):
    seen: list[dict] = []
    async with openai_client.realtime.connect(model="echo") as connection:
        await until(connection, "session.created", seen)
        await connection.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        updated = await until(connection, "session.updated", seen)
        assert updated["session"]["audio"]["input"]["turn_detection"] is None
        await say(connection, speech)
        await connection.input_audio_buffer.commit()  # GA: a commit creates no response
        await until(connection, "input_audio_buffer.committed", seen)
        metadata = {"client_event_id": "reply-1", "topic": "greeting"}
        await connection.response.create(response={"metadata": metadata})
        created = await until(connection, "response.created", seen)
        done = await until(connection, "response.done", seen)
        # a duplex-only event is refused as GA refuses an unknown one
        await connection.send({"type": "session.heartbeat", "event_id": "hb-1"})
        error = await until(connection, "error", seen)
    assert created["response"]["metadata"] == done["response"]["metadata"] == metadata
    assert done["response"]["status"] == "completed"
    kinds = types(seen)
    assert "input_audio_buffer.speech_started" not in kinds
    assert "input_audio_buffer.speech_stopped" not in kinds
    assert kinds.count("response.created") == 1  # the commit did not start one of its own
    assert (error["error"]["code"], error["error"]["event_id"]) == ("unknown_event", "hb-1")
