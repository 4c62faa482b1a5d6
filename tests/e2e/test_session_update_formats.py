"""A refused session.update leaves the client's appends in the format they were in, through
the whole server (`duplex serve`, real processes, the duplex surface, the echo model).

An append that declares no format crosses to the worker with the one the API pod resolved
for it. The pod used to apply a session.update to its parse defaults as it forwarded it:
when the worker refused the update (here: a voice change once audio has started, with a
new input rate in the same update), the appends after it crossed as 24 kHz audio while
the client still sent 16 kHz, and the echo heard a shorter turn than was spoken. An
accepted one still applies to the appends sent right behind it, before its answer."""

import asyncio
import base64

import orjson
import websockets

from harness.sessions import sine
from shared.client.duplex_client import DuplexClient, realtime_url
from shared.protocol.duplex import float_to_pcm16

RECV_TIMEOUT_S = 60  # a failure guard for a stuck socket, not a timing assertion


async def send(ws, event: dict) -> None:
    await ws.send(orjson.dumps(event).decode())


async def speak(ws, seconds: float, rate: int = 16000) -> None:
    """`seconds` of pcm16 in 20 ms appends that declare no format, then a commit."""
    pcm = float_to_pcm16(sine(rate, seconds))
    step = rate // 50 * 2
    for start in range(0, len(pcm), step):
        audio = base64.b64encode(pcm[start : start + step]).decode()
        await send(ws, {"type": "input_audio_buffer.append", "audio": audio})
    await send(ws, {"type": "input.commit"})


async def until(ws, wire_type: str) -> list[dict]:
    events = []
    while not events or events[-1]["type"] != wire_type:
        events.append(orjson.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)))
    return events


def transcript(events: list[dict]) -> str:
    done = [e for e in events if e["type"] == "response.output_audio_transcript.done"]
    return done[-1]["transcript"]


async def test_appends_after_a_refused_update_keep_the_session_input_format(serve):
    async with websockets.connect(realtime_url(serve.base), max_size=None) as ws:
        await send(
            ws, {"type": "session.update", "session": {"voice": "a", "extra_body": {"pace": 0}}}
        )
        assert (await until(ws, "session.created"))[-1]["session"]["audio"]["input"]["format"] == {
            "type": "audio/pcm",
            "rate": 16000,
        }
        await speak(ws, 0.2)
        assert transcript(await until(ws, "rate_limits.updated")) == "echo 200 ms"
        # audio has started: the voice is fixed, and the whole update is refused
        patch = {"voice": "b", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}}
        await send(ws, {"type": "session.update", "session": patch, "event_id": "u1"})
        await speak(ws, 0.3)  # right behind it, before any answer
        events = await until(ws, "rate_limits.updated")
        errors = [e["error"] for e in events if e["type"] == "error"]
        assert [(e["code"], e.get("event_id")) for e in errors] == [
            ("voice_update_after_audio_unsupported", "u1")
        ]
        assert "session.updated" not in [e["type"] for e in events]
        assert transcript(events) == "echo 300 ms"  # heard as it was spoken: 16 kHz


async def test_appends_right_behind_an_accepted_update_use_its_input_format(serve):
    async with websockets.connect(realtime_url(serve.base), max_size=None) as ws:
        await send(ws, {"type": "session.update", "session": {"extra_body": {"pace": 0}}})
        await until(ws, "session.created")
        patch = {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}}
        await send(ws, {"type": "session.update", "session": patch, "event_id": "u1"})
        await speak(ws, 0.3, rate=24000)  # right behind it, before any answer
        events = await until(ws, "rate_limits.updated")
        assert not [e for e in events if e["type"] == "error"]
        updated = [e for e in events if e["type"] == "session.updated"][-1]
        assert updated["session"]["audio"]["input"]["format"]["rate"] == 24000
        assert transcript(events) == "echo 300 ms"


async def test_the_duplex_client_follows_the_worker_not_its_own_update(serve):
    """`DuplexClient.append_audio` used to write the format of a session.update it had just
    sent into every append, answered or not: after a refusal it sent 24 kHz declarations
    with 16 kHz audio. It now sends appends that declare no format (the server reads them
    in the session's format as the worker has it) and follows session.updated."""
    client = await DuplexClient(serve.base, heartbeat_s=None).connect({"extra_body": {"pace": 0}})
    try:
        pcm = float_to_pcm16(sine(16000, 0.2))
        for start in range(0, len(pcm), 640):
            await client.append_audio(pcm[start : start + 640])
        await client.commit()
        await client.until("response.done", timeout=RECV_TIMEOUT_S)
        patch = {"voice": "b", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}}
        await client.send({"type": "session.update", "session": patch, "event_id": "u1"})
        pcm = float_to_pcm16(sine(16000, 0.3))
        for start in range(0, len(pcm), 640):
            await client.append_audio(pcm[start : start + 640])
        await client.commit()
        events = await client.until("response.done", timeout=RECV_TIMEOUT_S)
        errors = [e for e in events if e.wire_type == "error"]
        assert [e.code for e in errors] == ["voice_update_after_audio_unsupported"]
        assert events[-1].response["output"][0]["content"][0]["transcript"] == "echo 300 ms"
    finally:
        await client.close()
