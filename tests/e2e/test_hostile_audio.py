"""WAV appends whose header declares an absurd rate, against real processes (issue 14).

A 6 KB WAV declaring 1 Hz once resampled 16 000x: the worker grew by 491 MiB (a
26 KB frame: 1.8 GB). Now each is refused at submit with `unsupported_audio_format`,
the worker's memory stays put, and a control session on the same worker keeps
getting its echo.
"""

import asyncio
import base64
import struct
import uuid
from pathlib import Path

import orjson
import pytest
import websockets

from harness.processes import start_api, start_worker
from harness.sessions import sine
from shared.client.duplex_client import DuplexClient, realtime_url
from shared.protocol.duplex import float_to_pcm16

MIB = 1024 * 1024
#: Generous for allocator noise; one refused 6 KB append used to cost 491 MiB.
RSS_GROWTH_BOUND = 100 * MIB
RECV_TIMEOUT_S = 60  # a failure guard for a stuck socket, not a timing assertion


def wav(payload_bytes: int, rate: int, channels: int = 1, bits: int = 16) -> str:
    """A base64 mono PCM WAV of silence with the header's rate, channels and bits as given."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * block & 0xFFFFFFFF, block, bits)
    body = b"fmt " + struct.pack("<I", 16) + fmt
    body += b"data" + struct.pack("<I", payload_bytes) + bytes(payload_bytes)
    return base64.b64encode(b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WAVE" + body).decode()


HOSTILE = {
    "one-hz-6k": wav(6 * 1024, 1),
    "one-hz-26k": wav(26 * 1024, 1),
    "rate-4ghz": wav(6 * 1024, 0xFFFFFFFF),
    "rate-192001": wav(6 * 1024, 192_001),
    "channels-0": wav(6 * 1024, 16000, channels=0),
    "bits-12": wav(6 * 1024, 16000, bits=12),
}


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def processes(redis_server):
    prefix = f"duplex-test-{uuid.uuid4().hex[:8]}"
    worker = start_worker(redis_server.url, prefix)
    apis = [start_api(redis_server.url, prefix, f"api-{i}") for i in range(2)]
    try:
        for api in apis:
            api.wait_ready()
        yield worker, apis
    finally:
        for process in [*apis, worker]:
            process.stop()


async def hostile(base: str) -> dict[str, dict]:
    """Send every hostile append; return the `error` object answering each, by event id."""
    async with websockets.connect(realtime_url(base), max_size=None) as ws:
        await ws.send('{"type":"session.update","session":{"extra_body":{"pace":0}}}')
        created = orjson.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))
        assert created["type"] == "session.created"
        for event_id, audio in HOSTILE.items():
            append = {"type": "input_audio_buffer.append", "audio": audio, "event_id": event_id}
            await ws.send(orjson.dumps(append).decode())
        errors: dict[str, dict] = {}
        while len(errors) < len(HOSTILE):
            event = orjson.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))
            assert event["type"] != "input_audio_buffer.speech_started", event  # none was taken
            if event["type"] == "error":
                errors[event["error"].get("event_id")] = event["error"]
        return errors


async def echo_turn(client: DuplexClient, seconds: float) -> str:
    pcm = float_to_pcm16(sine(16000, seconds))
    for i in range(0, len(pcm), 640):
        await client.append_audio(pcm[i : i + 640])
    await client.send({"type": "input.commit"})
    events = await client.until("rate_limits.updated", timeout=RECV_TIMEOUT_S)
    done = next(e for e in events if e.wire_type == "response.output_audio_transcript.done")
    assert events[-2].response["status"] == "completed"
    return done.transcript


async def test_absurd_wav_rates_are_refused_and_the_worker_stays_small(processes):
    worker, (hostile_api, control_api) = processes
    control = DuplexClient([control_api.base], heartbeat_s=None)
    await control.connect({"extra_body": {"pace": 0}})
    try:
        assert await echo_turn(control, 0.2) == "echo 200 ms"  # warm: imports, resampler, buffers
        baseline = rss_bytes(worker.process.pid)

        errors, transcript = await asyncio.gather(
            hostile(hostile_api.base), echo_turn(control, 0.4)
        )

        assert transcript == "echo 400 ms"
        assert {event_id: error["code"] for event_id, error in errors.items()} == {
            event_id: "unsupported_audio_format" for event_id in HOSTILE
        }
        assert {error["param"] for error in errors.values()} == {"audio"}
        assert await echo_turn(control, 0.3) == "echo 300 ms"  # the same worker, still answering
        growth = rss_bytes(worker.process.pid) - baseline
        assert growth < RSS_GROWTH_BOUND, f"worker grew by {growth / MIB:.0f} MiB"
        assert worker.process.poll() is None
    finally:
        await control.close()
