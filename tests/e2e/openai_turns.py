"""One realtime turn as the official openai SDK speaks it (GA events), for the tests that
run it against a server (tests/e2e/test_openai_sdk.py, tests/images)."""

from __future__ import annotations

import base64
from dataclasses import dataclass

from openai import AsyncOpenAI

from harness.sessions import sine
from shared.protocol.duplex import float_to_pcm16


@dataclass
class Turn:
    kinds: list[str]  # the type of every event received, in order
    audio: bytes  # the response's pcm16
    transcript: str | None
    status: str  # response.done's status


async def realtime_turn(base_url: str, model: str = "echo", seconds: float = 0.5) -> Turn:
    """Connect with the SDK, say `seconds` of a 24 kHz sine in 40 ms appends, commit, ask
    for a response, and read until its `response.done` (or an `error`: its status is then
    `error <code>`)."""
    client = AsyncOpenAI(api_key="unused", base_url=f"{base_url}/v1")
    pcm = float_to_pcm16(sine(24000, seconds))
    async with client.realtime.connect(model=model) as connection:
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
        await connection.input_audio_buffer.commit()
        await connection.response.create()
        kinds, audio, transcript = [], b"", None
        async for event in connection:
            kinds.append(event.type)
            if event.type == "response.output_audio.delta":
                audio += base64.b64decode(event.delta)
            if event.type == "response.output_audio_transcript.done":
                transcript = event.transcript
            if event.type == "response.done":
                return Turn(kinds, audio, transcript, str(event.response.status))
            if event.type == "error":  # the turn was refused: no response.done will come
                return Turn(kinds, audio, transcript, f"error {event.error.code}")
    raise AssertionError("the connection ended before response.done")
