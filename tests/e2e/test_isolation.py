"""Malformed input on one session gets the contract's errors; another session is unaffected."""

import asyncio
import base64

import orjson
import websockets

from harness.sessions import sine
from shared.client.duplex_client import DuplexClient, realtime_url
from shared.protocol.duplex import float_to_pcm16


async def abuse(base: str) -> list[str]:
    """Send garbage on one socket; return the error codes it got back, in order."""
    codes = []
    async with websockets.connect(realtime_url(base), max_size=None) as ws:
        await ws.send('{"type":"session.update","session":{"extra_body":{"pace":0}}}')
        assert orjson.loads(await ws.recv())["type"] == "session.created"
        frames = [
            "{not json",
            "[1,2,3]",
            '{"no":"type"}',
            '{"type":"response.explode","event_id":"x1"}',
            '{"type":"input_audio_buffer.append","audio":"%%%","event_id":"x2"}',
            '{"type":"input_audio_buffer.append","audio":"AAAA","format":"mp3"}',
            '{"type":"session.resume","session_id":"s","resume_token":"t"}',
            '{"type":"session.event_ack","server_event_seq":999}',
            '{"type":"x","pad":"' + "y" * (15 * 1024 * 1024) + '"}',
        ]
        for frame in frames:
            await ws.send(frame)
        big = base64.b64encode(bytes(1024 * 1024)).decode()  # 1 MiB of audio per append: a flood
        for _ in range(20):
            await ws.send(
                orjson.dumps({"type": "input_audio_buffer.append", "audio": big}).decode()
            )
        await ws.send('{"type":"session.heartbeat"}')
        while True:
            event = orjson.loads(await asyncio.wait_for(ws.recv(), 30))
            if event["type"] == "error":
                codes.append(event["error"]["code"])
            if event["type"] == "session.heartbeat_ack":
                return codes


async def test_garbage_on_one_session_does_not_touch_another(cluster):
    a, b = cluster.apis
    client = DuplexClient([b.base], heartbeat_s=None)
    await client.connect({"extra_body": {"pace": 0}})
    try:
        pcm = float_to_pcm16(sine(16000, 0.4))

        async def normal_turn():
            for i in range(0, len(pcm), 640):
                await client.append_audio(pcm[i : i + 640])
            await client.send({"type": "input.commit"})
            return await client.until("rate_limits.updated", timeout=60)

        codes, events = await asyncio.gather(abuse(a.base), normal_turn())
        assert codes[:9] == [
            "invalid_json",
            "bad_event",
            "bad_event",
            "unknown_event",
            "bad_audio",
            "unsupported_audio_format",
            "unsupported_session_resume",
            "invalid_event_ack",
            "event_too_large",
        ]
        assert set(codes[9:]) == {
            "input_backpressure"
        }  # the flood is refused, not buffered forever
        assert len(codes[9:]) >= 3
        transcript = next(
            e for e in events if e.wire_type == "response.output_audio_transcript.done"
        )
        assert transcript.transcript == "echo 400 ms"
        assert events[-2].response["status"] == "completed"
    finally:
        await client.close()
