"""The official openai SDK is a client of `duplex serve` (GA realtime, chat, models)."""

import base64

import pytest
from openai import AsyncOpenAI

from harness.sessions import sine
from shared.protocol.duplex import float_to_pcm16


@pytest.fixture
def openai_client(serve):
    return AsyncOpenAI(api_key="unused", base_url=f"{serve.base}/v1")


async def test_a_realtime_turn_with_the_openai_sdk(openai_client):
    pcm = float_to_pcm16(sine(24000, 0.5))
    async with openai_client.realtime.connect(model="echo") as connection:
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
                assert event.response.status == "completed"
                break
    assert kinds[0] == "session.created" and "session.updated" in kinds
    assert kinds.count("response.output_audio.delta") == 5
    assert transcript == "echo 500 ms"
    assert len(audio) == 24000  # 0.5 s of pcm16 at 24 kHz


async def test_chat_completions_and_models_with_the_openai_sdk(openai_client):
    models = await openai_client.models.list()
    assert [m.id for m in models.data] == ["echo"]
    completion = await openai_client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hello duplex"}]
    )
    assert completion.choices[0].message.content == "echo: hello duplex"
    stream = await openai_client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "a b c"}], stream=True
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text == "echo: a b c"
