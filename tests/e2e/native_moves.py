"""A model-native session's move with real processes, for any frame-clocked plugin: two
workers of it behind one `duplex api` on redis-server, a client streaming audio in real
time, SIGTERM (a drain: the session moves at once) or SIGKILL (a failover from the last
written history) of the owner. Checked: the session goes on on the other worker with its
history replayed (the restored-frames metric says how many frames came back, and the
history in Redis grows on past them), seqs stay contiguous, no `input_lost` and no error
reach the client, and the model speaks again. Every wait is for something the client,
Redis or /metrics shows. Used by tests/e2e/test_native_moves.py (the echo frame model) and
tests/moshi/test_moshi_e2e.py (the tiny Moshi)."""

from __future__ import annotations

import asyncio
import re
import signal
import uuid
from pathlib import Path

import httpx
import numpy as np

from bench.chaos import RecordingClient, drain
from harness.frame_models import RATE, tone
from harness.processes import start_api, start_worker
from harness.redis_server import free_port
from shared.protocol.duplex import float_to_pcm16
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from tests.e2e.waits import until

CHECKOUT = str(Path(__file__).resolve().parents[2])
FAST = {"DUPLEX_HEARTBEAT_INTERVAL_S": "0.2", "DUPLEX_HEARTBEAT_TTL_S": "2.0"}


async def stream(client: RecordingClient, stop: asyncio.Event) -> None:
    """Real-time microphone audio: 80 ms a chunk, speech then quiet, until stopped (the
    pacing is the microphone's, not an ordering of events)."""
    speech = np.concatenate([tone(5), np.zeros(RATE // 2, np.float32)])
    pcm = float_to_pcm16(speech)
    step = RATE * 2 * 80 // 1000
    while not stop.is_set():
        for start in range(0, len(pcm), step):
            if stop.is_set():
                return
            await client.append_audio(
                pcm[start : start + step], format="pcm16", sample_rate_hz=RATE
            )
            await asyncio.sleep(0.08)


def restored_frames(port: int, model: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    pattern = rf'duplex_native_restored_frames_total\{{model="{model}"\}} ([0-9.e+]+)'
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


async def move_a_native_session(
    redis_url: str,
    how: signal.Signals,
    *,
    plugin: str,
    model: str,
    record_bytes: int,
    **worker_env: str,
) -> tuple[bytes, int]:
    """Stream into a native session, kill or drain its worker, check it goes on (above);
    returns the model history as the new worker has written it, and the frames restored."""
    prefix = f"native-moves-{uuid.uuid4().hex[:6]}"
    keys = KeySchema(prefix)
    ports = {name: free_port() for name in ("w-a", "w-b")}
    workers = {
        name: start_worker(
            redis_url,
            prefix,
            name,
            plugin,
            DUPLEX_WORKER_HEALTH_PORT=str(port),
            PYTHONPATH=CHECKOUT,
            **FAST,
            **worker_env,
        )
        for name, port in ports.items()
    }
    api = start_api(redis_url, prefix, "native-api", **FAST)
    handle = connect(redis_url)
    redis = handle.client
    stop = asyncio.Event()
    client = RecordingClient([api.base], heartbeat_s=None)
    tasks: list[asyncio.Task[None]] = []
    try:
        api.wait_ready()
        await until(lambda: redis.zcard(keys.workers()), lambda n: n >= 2, 120)
        await client.connect({"model": model})
        tasks += [asyncio.create_task(drain(client)), asyncio.create_task(stream(client, stop))]
        sid = client.session_id
        owner = (await redis.hget(keys.session(sid), "worker")).decode()
        other = next(name for name in workers if name != owner)
        # the model has heard a while, and its history is in Redis (about once a second)
        history = keys.model_history(sid)
        await until(lambda: redis.strlen(history), lambda n: n >= record_bytes * 25)
        spoke_before = sum(1 for f in client.delivered if f.get("type") == "response.created")
        workers[owner].process.send_signal(how)
        await until(
            lambda: redis.hget(keys.session(sid), "worker"), lambda w: w == other.encode(), 40
        )
        frames = await until(
            lambda: asyncio.to_thread(restored_frames, ports[other], model), lambda n: n >= 25, 30
        )
        since = len(client.delivered)
        await until(
            lambda: asyncio.sleep(0, len(client.delivered)),
            lambda _: any(
                f.get("type") == "response.output_audio.delta" for f in client.delivered[since:]
            ),
            30,
        )
        # the restored slot goes on: the new worker appends to the history it replayed
        written = await until(lambda: redis.get(history), lambda d: len(d) > frames * record_bytes)
        assert len(written) % record_bytes == 0
        errors = [f for f in client.delivered if f.get("type") == "error"]
        assert errors == []  # no input_lost, no worker_lost: nothing the client must do
        seqs = [f["server_event_seq"] for f in client.delivered if "server_event_seq" in f]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert spoke_before >= 1
        assert client.ended is None
        return written, int(frames)
    finally:
        stop.set()
        await client.close(end_session=False)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        api.stop()
        for worker in workers.values():
            worker.stop()
        await handle.close()
