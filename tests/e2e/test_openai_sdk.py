"""The official openai SDK is a client of `duplex serve` (GA realtime, chat, models)."""

import pytest
from openai import AsyncOpenAI

from tests.e2e.openai_turns import realtime_turn


@pytest.fixture
def openai_client(serve):
    return AsyncOpenAI(api_key="unused", base_url=f"{serve.base}/v1")


async def test_a_realtime_turn_with_the_openai_sdk(serve):
    turn = await realtime_turn(serve.base)
    assert turn.status == "completed"
    assert turn.kinds[0] == "session.created" and "session.updated" in turn.kinds
    assert turn.kinds.count("response.output_audio.delta") == 5
    assert turn.transcript == "echo 500 ms"
    assert len(turn.audio) == 24000  # 0.5 s of pcm16 at 24 kHz


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
