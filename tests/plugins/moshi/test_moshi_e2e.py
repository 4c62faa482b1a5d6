"""The Moshi plugin end to end: redis-server, `duplex api` and `duplex worker --plugin moshi
--model-dir DIR` as real processes of this venv (harness/processes.py runs the `duplex` next
to this interpreter), the tiny random checkpoint, and a WebSocket client on
`/v1/realtime?duplex=1` streaming 24 kHz pcm16: the model hears, decides to speak (its random
text stream is words on most frames) and its Mimi-decoded voice comes back as audio deltas;
a barge-in cancels that response (the stage interrupts the session's slot, which keeps its
memory); and a session whose worker is drained or killed goes on on another with its
model's memory replayed."""

from __future__ import annotations

import base64
import signal

import httpx
import numpy as np
import pytest

from shared.client.duplex_client import DuplexClient
from shared.protocol.duplex import float_to_pcm16
from tests.e2e.native_moves import move_a_native_session
from tests.plugins.moshi.conftest import GREEDY_OPTIONS, moshi_stack, user_audio

RATE = 24_000


@pytest.fixture(scope="module")
def moshi_cluster(redis_server, tiny_dir):
    with moshi_stack(redis_server.url, tiny_dir, "moshi") as stack:
        yield stack


async def send_pcm(client: DuplexClient, samples: np.ndarray) -> None:
    pcm = float_to_pcm16(samples)
    step = RATE // 25 * 2  # 40 ms appends
    for start in range(0, len(pcm), step):
        await client.append_audio(pcm[start : start + step], format="pcm16", sample_rate_hz=RATE)


async def test_a_moshi_session_speaks_back_and_a_barge_in_cancels(moshi_cluster):
    api, health, _ = moshi_cluster
    client = DuplexClient([api.base], heartbeat_s=None)
    await client.connect({})
    try:
        capabilities = client.session["capabilities"]
        assert capabilities["implementation_level"] == "model_native_duplex"
        await send_pcm(client, user_audio(7, 25).reshape(-1))  # 2 s of user audio
        events = await client.until("response.output_audio.delta", timeout=60)
        kinds = [e.wire_type for e in events]
        assert "response.created" in kinds
        audio = base64.b64decode(events[-1].delta)
        assert len(audio) > 0
        response_id = events[-1].response_id
        more = await client.until("response.output_audio.delta", timeout=30)
        assert more[-1].response_id == response_id

        await client.send({"type": "barge_in"})
        done = (await client.until("response.done", timeout=30))[-1]
        assert done.response_id == response_id
        assert done.response["status"] == "cancelled"
        # the slot was reset, not the worker: the model speaks again, in a new response
        await send_pcm(client, user_audio(8, 12).reshape(-1))
        created = (await client.until("response.created", timeout=60))[-1]
        assert created.response_id != response_id
    finally:
        await client.close()
    metrics = httpx.get(f"http://127.0.0.1:{health}/metrics", timeout=5).text
    assert 'duplex_tick_duration_seconds_count{model="moshi"}' in metrics


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["drain", "failover"])
async def test_a_moshi_session_keeps_its_models_memory_when_its_worker_goes(
    redis_server, tiny_dir, how
):
    """Two tiny-Moshi workers: the owner drained or killed mid-conversation; the other
    replays the session's model history (its records: the LM's 5 tokens and the barge-in's
    silence a frame here, 12 bytes) and the conversation goes on with no error
    (tests/e2e/native_moves.py checks it)."""
    written, frames = await move_a_native_session(
        redis_server.url,
        how,
        plugin="moshi",
        model="moshi",
        record_bytes=12,
        DUPLEX_MODEL_DIR=str(tiny_dir),
        DUPLEX_PLUGIN_OPTIONS=GREEDY_OPTIONS,
        DUPLEX_MAX_SESSIONS="2",
        HF_HUB_OFFLINE="1",
    )
    assert frames >= 25 and len(written) > frames * 12
