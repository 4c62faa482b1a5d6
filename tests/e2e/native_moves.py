"""A model-native session's move with real processes, for any frame-clocked plugin: two
workers of it behind one `duplex api` on redis-server, a client streaming audio in real
time, SIGTERM (a drain: the session moves at once) or SIGKILL (a failover from the last
written history) of the owner. Checked: the session goes on on the other worker with its
history replayed (the restored-frames metric says how many frames came back, and the
history in Redis grows on past them), seqs stay contiguous, no `input_lost` and no error
reach the client, and the model speaks again. Every wait is for something the client,
Redis or /metrics shows. Used by tests/e2e/test_native_moves.py (the echo frame model) and
tests/plugins/moshi/test_moshi_e2e.py (the tiny Moshi)."""

from __future__ import annotations

import asyncio
import re
import signal
import uuid
from pathlib import Path

import httpx
import numpy as np
import orjson

from harness.frame_models import RATE, tone
from harness.processes import start_api, start_worker
from harness.recording_client import RecordingClient, drain
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


class NativeFleet:
    """Workers of a frame-clocked plugin (by name, each with its health port) behind one
    API pod, and a client streaming into one native session (`open`)."""

    def __init__(self, redis_url: str, names: list[str], plugin: str, **worker_env: str):
        self.redis_url, self.plugin = redis_url, plugin
        self.prefix = f"native-moves-{uuid.uuid4().hex[:6]}"
        self.keys = KeySchema(self.prefix)
        self.env = {"PYTHONPATH": CHECKOUT, **FAST, **worker_env}
        self.ports = {name: free_port() for name in names}
        self.workers = {name: self._worker(name) for name in names}
        self.api = start_api(redis_url, self.prefix, "native-api", **FAST)
        self.handle = connect(redis_url)
        self.redis = self.handle.client
        self.client = RecordingClient([self.api.base], heartbeat_s=None)
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def _worker(self, name: str):
        port = str(self.ports[name])
        return start_worker(
            self.redis_url,
            self.prefix,
            name,
            self.plugin,
            DUPLEX_WORKER_HEALTH_PORT=port,
            **self.env,
        )

    def restart(self, name: str) -> None:
        """The worker started again under its id and health port (it was killed)."""
        self.workers[name].process.wait()
        self.workers[name] = self._worker(name)

    async def open(self, model: str, record_bytes: int, load_s: float = 60) -> str:
        """Every worker registered (a worker loads its model first: up to `load_s`), a
        session open and streamed into until its model history in Redis holds 25 frames;
        its id."""
        self.api.wait_ready(timeout=load_s)
        await until(
            lambda: self.redis.zcard(self.keys.workers()), lambda n: n >= len(self.workers), 120
        )
        await self.client.connect({"model": model})
        self.tasks += [
            asyncio.create_task(drain(self.client)),
            asyncio.create_task(stream(self.client, self.stop)),
        ]
        sid = self.client.session_id
        history = self.keys.model_history(sid)
        await until(lambda: self.redis.strlen(history), lambda n: n >= record_bytes * 25)
        return sid

    async def owner(self, sid: str) -> bytes:
        return await self.redis.hget(self.keys.session(sid), "worker")

    async def restored(self, name: str, model: str) -> int:
        """Frames the worker's restores replayed (waiting until it is at least 25)."""
        port = self.ports[name]
        return int(
            await until(lambda: asyncio.to_thread(restored_frames, port, model), lambda n: n >= 25)
        )

    def check_no_error_and_contiguous(self) -> None:
        """Nothing the client must act on (no input_lost, no worker_lost), no seq gap."""
        client = self.client
        assert [f for f in client.delivered if f.get("type") == "error"] == []
        seqs = [f["server_event_seq"] for f in client.delivered if "server_event_seq" in f]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert client.ended is None

    async def close(self) -> None:
        self.stop.set()
        await self.client.close(end_session=False)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.api.stop()
        for worker in self.workers.values():
            worker.stop()
        await self.handle.close()


async def move_a_native_session(
    redis_url: str,
    how: signal.Signals,
    *,
    plugin: str,
    model: str,
    record_bytes: int,
    load_s: float = 60,
    **worker_env: str,
) -> tuple[bytes, int]:
    """Stream into a native session, kill or drain its worker, check it goes on (above);
    returns the model history as the new worker has written it, and the frames restored."""
    fleet = NativeFleet(redis_url, ["w-a", "w-b"], plugin, **worker_env)
    try:
        sid = await fleet.open(model, record_bytes, load_s)
        client = fleet.client
        owner = (await fleet.owner(sid)).decode()
        other = next(name for name in fleet.workers if name != owner)
        spoke_before = sum(1 for f in client.delivered if f.get("type") == "response.created")
        fleet.workers[owner].process.send_signal(how)
        await until(lambda: fleet.owner(sid), lambda w: w == other.encode(), 40)
        frames = await fleet.restored(other, model)
        # the new worker says how far its restore is in the session's hash, and that it ended
        report = await until(
            lambda: fleet.redis.hget(fleet.keys.session(sid), "restore"),
            lambda data: data is not None and orjson.loads(data)["done"],
            20,
        )
        progress = orjson.loads(report)
        assert progress["frames"] == progress["replayed"] == frames > 0
        assert progress["pace"] > 0 and progress["seconds"] >= 0
        since = len(client.delivered)
        await until(
            lambda: asyncio.sleep(0, len(client.delivered)),
            lambda _: any(
                f.get("type") == "response.output_audio.delta" for f in client.delivered[since:]
            ),
            30,
        )
        # the restored slot goes on: the new worker appends to the history it replayed
        history = fleet.keys.model_history(sid)
        written = await until(
            lambda: fleet.redis.get(history), lambda d: len(d) > frames * record_bytes
        )
        assert len(written) % record_bytes == 0
        fleet.check_no_error_and_contiguous()
        assert spoke_before >= 1
        return written, frames
    finally:
        await fleet.close()
