"""The GA input features through the whole server (`duplex serve`, real processes, the
duplex surface `/v1/realtime?duplex=1`): idle_timeout_ms and semantic_vad on the echo
model with synthesized speech and silence, and input transcription deltas (and semantic
turn ends) from the assistant's Whisper recogniser.

Decisions are asserted in audio time (where speech and turns start and end in the input
stream), never in wall time."""

import asyncio

import numpy as np
import pytest

from harness.processes import start_serve
from harness.speech import overlap, say, spoken
from shared.client.duplex_client import DuplexClient

DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
TIMEOUT = "input_audio_buffer.timeout_triggered"
AUDIO_16K = {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}


def session(turn_detection: dict, **more) -> dict:
    return {**AUDIO_16K, "turn_detection": turn_detection, "extra_body": {"pace": 0}, **more}


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * 16000), np.float32)


async def send_fast(client: DuplexClient, audio: np.ndarray) -> None:
    """All of `audio` at once, in 20 ms appends: the VAD decides on audio time."""
    from shared.protocol.duplex import float_to_pcm16

    pcm = float_to_pcm16(audio)
    for i in range(0, len(pcm), 640):
        await client.append_audio(pcm[i : i + 640])


def of(events, kind):
    return [e for e in events if e.wire_type == kind]


async def connect(server, config: dict) -> DuplexClient:
    return await DuplexClient(server.base, heartbeat_s=None).connect(config)


# ---------------------------------------------------------------- idle_timeout_ms (echo)


async def test_an_idle_user_is_prompted_while_silence_streams(serve):
    client = await connect(serve, session({"type": "server_vad", "idle_timeout_ms": 1500}))
    try:
        await say(client, spoken("hello", tail_s=0.8))
        first = await client.until("response.done")
        # the user stays silent, streaming like an open microphone
        streaming = asyncio.create_task(say(client, silence(8)))
        events = await client.until(TIMEOUT, timeout=30)
        assert not of(events, "input_audio_buffer.speech_started")
        fired = events[-1]
        assert fired.audio_end_ms - fired.audio_start_ms >= 1500  # idle_timeout_ms of silence
        events = await client.until("response.created")
        assert [e.item_id for e in of(events, "input_audio_buffer.committed")] == [fired.item_id]
        added = of(events, "conversation.item.added")[0].item
        assert added["role"] == "user" and added["content"][0]["type"] == "input_audio"
        assert events[-1].response_id != first[-1].response_id  # the model follows up
        streaming.cancel()
    finally:
        await client.close()


async def test_a_client_that_stops_sending_audio_is_prompted_too(serve):
    client = await connect(serve, session({"type": "server_vad", "idle_timeout_ms": 1000}))
    try:
        await say(client, spoken("hello", tail_s=0.8))
        await client.until("response.done")
        # no more audio at all: the worker's wall-clock check fires the timeout
        events = await client.until(TIMEOUT, timeout=30)
        fired = events[-1]
        assert fired.audio_start_ms <= fired.audio_end_ms
        events = await client.until("response.created")
        assert of(events, "input_audio_buffer.committed")[0].item_id == fired.item_id
    finally:
        await client.close()


# ---------------------------------------------------------------- semantic_vad (echo)


@pytest.mark.parametrize(("eagerness", "turns"), [("high", 2), ("low", 1)])
async def test_semantic_vad_eagerness_decides_whether_a_pause_ends_the_turn(
    serve, eagerness, turns
):
    """The echo model has no recogniser: the eagerness-scaled silence decides. A 0.8 s
    pause ends the turn at `high` (0.3 s) but not at `low` (1.5 s)."""
    client = await connect(serve, session({"type": "semantic_vad", "eagerness": eagerness}))
    try:
        first = spoken("hello", lead_s=0.4, tail_s=0.8)
        second = spoken("thank you", lead_s=0.0, tail_s=0.0)
        end_ms = (len(first) + len(second)) * 1000 // 16000
        await send_fast(client, np.concatenate([first, second, silence(2.5)]))
        stopped = []
        while not stopped or stopped[-1].audio_end_ms < end_ms - 500:
            events = await client.until("input_audio_buffer.speech_stopped")
            stopped.append(events[-1])
        await client.until("input_audio_buffer.committed")
        assert len(stopped) == turns
    finally:
        await client.close()


# ---------------------------------------------------------------- the assistant's Whisper


@pytest.fixture(scope="module")
def assistant():
    # Whisper, the recogniser with partials (pocketsphinx, `hybrid`, has none)
    process = start_serve(
        "serve-assistant-ga", ("--plugin", "assistant"), DUPLEX_ASSISTANT_ASR="whisper"
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


async def test_whisper_streams_transcription_deltas_while_the_user_speaks(assistant):
    config = session({"type": "server_vad"}, input_audio_transcription={"model": "whisper-1"})
    client = await connect(assistant, config)
    try:
        said = "what is your name and what time is it"
        await say(client, spoken(said, tail_s=1.0))
        events = await client.until(COMPLETED, timeout=60)
        completed = events[-1]
        deltas = of(events, DELTA)
        assert deltas, "no partial transcript while the user spoke"
        assert {d.item_id for d in deltas} == {completed.item_id}
        kinds = [e.wire_type for e in events]
        assert max(i for i, k in enumerate(kinds) if k == DELTA) < kinds.index(
            "input_audio_buffer.committed"
        )
        # what the partials said, and when, depends on how fast the machine decodes them:
        # words in common, with test_whisper's margin (its measured worst for a whole
        # phrase was 0.75), not an exact first word
        streamed = "".join(d.delta for d in deltas)
        assert overlap(streamed, said) >= 0.5, streamed
        assert overlap(completed.transcript, said) >= 0.5, completed.transcript
    finally:
        await client.close()


async def test_whisper_punctuation_ends_a_semantic_turn_at_a_short_pause(assistant):
    """eagerness low: without a verdict a turn ends after 1.5 s of silence; a finished
    question ("What time is it?") ends it after 0.75 s. The client streams the question and
    only 1.2 s of silence after it, then nothing: the turn can only end on the verdict."""
    client = await connect(assistant, session({"type": "semantic_vad", "eagerness": "low"}))
    try:
        await say(client, spoken("what time is it", lead_s=0.4, tail_s=1.2))
        events = await client.until("input_audio_buffer.committed", timeout=10)
        assert of(events, "input_audio_buffer.speech_stopped")
    finally:
        await client.close()
