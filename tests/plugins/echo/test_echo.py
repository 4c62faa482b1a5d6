"""The echo plugin and its stage on their own."""

import asyncio

import numpy as np
import pytest

from plugins.echo import EchoPlugin, EchoRequest, EchoStagePort
from plugins.paced import split_text
from services.worker.plugins import load_plugin
from shared.contracts import DuplexFence, DuplexRuntimeConfigError, DuplexSessionConfig, StagePlan


def test_capabilities():
    caps = EchoPlugin().capabilities(max_sessions=8)
    assert caps.supports_session_resume and caps.supports_barge_in and caps.supports_playback_ack
    assert (
        caps.supports_audio_truncate
        and caps.supports_chat_completions
        and caps.supports_multi_session
    )
    assert not caps.supports_model_native_turn_policy  # a user turn ends on commit or VAD
    assert not EchoPlugin().capabilities(max_sessions=1).supports_multi_session


async def test_chat_completion_echoes_the_last_user_message():
    messages = [
        {"role": "system", "content": "x"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "y"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}],
        },
    ]
    assert await EchoPlugin().chat_completion(messages) == "echo: hello there"
    assert await EchoPlugin().chat_completion([]) == "echo: "


async def test_pace_is_validated():
    plugin = EchoPlugin()
    assert await plugin.prepare_runtime_config(DuplexSessionConfig()) == {"pace": 1.0}
    assert await plugin.prepare_runtime_config(DuplexSessionConfig(extra_body={"pace": 0})) == {
        "pace": 0.0
    }
    for bad in (-1, "fast", True):
        with pytest.raises(DuplexRuntimeConfigError):
            plugin.validate_client_extra_body({"pace": bad})


@pytest.mark.parametrize("pieces", [1, 3, 12, 40])
def test_split_text_joins_back(pieces):
    parts = split_text("echo 1234 ms", pieces)
    assert len(parts) == pieces and "".join(parts) == "echo 1234 ms"


def test_plugin_loader():
    assert isinstance(load_plugin("echo"), EchoPlugin)
    assert isinstance(load_plugin("plugins.echo:EchoPlugin"), EchoPlugin)
    with pytest.raises(ValueError):
        load_plugin("nope")
    with pytest.raises(TypeError):
        load_plugin("plugins.echo:EchoRequest")


async def test_abort_stops_generation_inside_the_stage():
    port = EchoStagePort()
    outputs = []
    port.bind("s1", outputs.append)
    fence = DuplexFence("s1", 0, 1)
    request_id = await port.ensure(fence, "stage0")
    audio = np.zeros(16000 * 3, np.float32)
    await port.submit_initial(
        StagePlan(request_id, fence, "stage0", EchoRequest(audio, 16000, 24000, "echo 3000 ms"))
    )
    async with asyncio.timeout(10):
        while not outputs:
            await asyncio.sleep(0.01)
    await port.abort([request_id])
    count = len(outputs)
    assert port.running_requests() == []
    await asyncio.sleep(0.25)  # time itself is tested: the pacing had 2.5 chunks to go on
    assert len(outputs) == count < 30  # real-time pacing was stopped, not drained
    assert all(o.kind == "audio" for o in outputs)
    await port.cleanup("s1")


async def test_fast_pace_streams_everything_with_done_last():
    port = EchoStagePort()
    outputs = []
    port.bind("s1", outputs.append)
    fence = DuplexFence("s1", 0, 1)
    request_id = await port.ensure(fence, "stage0")
    request = EchoRequest(np.full(16000, 0.1, np.float32), 16000, 24000, "echo 1000 ms", pace=0)
    await port.submit_initial(StagePlan(request_id, fence, "stage0", request))
    async with asyncio.timeout(10):
        while not outputs or outputs[-1].kind != "done":
            await asyncio.sleep(0.01)
    audio = [o for o in outputs if o.kind == "audio"]
    assert len(audio) == 10 and all(len(o.audio) == 2400 for o in audio)
    assert "".join(o.text for o in audio) == outputs[-1].text == "echo 1000 ms"
    assert {o.request_id for o in outputs} == {request_id}
