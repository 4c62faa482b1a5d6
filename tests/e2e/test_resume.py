"""The session survives its socket and its API pod: resume anywhere, miss nothing."""

import asyncio
import base64

import numpy as np
import orjson
import websockets

from harness.sessions import sine
from plugins.echo.stage import resample_whole
from shared.client.duplex_client import DuplexClient, DuplexClientError, realtime_url
from shared.protocol.duplex import AudioFormat, DuplexInputConverter, float_to_pcm16

REAL_TIME = {"extra_body": {"pace": 1}}


def expected_echo(pcm: bytes, rate: int) -> bytes:
    converter = DuplexInputConverter()
    step = rate // 50 * 2
    pieces = [
        converter.convert(pcm[i : i + step], AudioFormat("pcm16", rate))
        for i in range(0, len(pcm), step)
    ]
    return float_to_pcm16(
        resample_whole(np.concatenate([*pieces, converter.flush()]), 16000, 24000)
    )


async def speak(client: DuplexClient, seconds: float = 1.0, rate: int = 16000) -> bytes:
    pcm = float_to_pcm16(sine(rate, seconds))
    step = rate // 50 * 2  # 20 ms appends
    for i in range(0, len(pcm), step):
        await client.append_audio(pcm[i : i + step], format="pcm16", sample_rate_hz=rate)
    await client.send({"type": "input.commit"})
    return pcm


async def test_resume_on_another_pod_after_sigkill(cluster):
    doomed, survivor = cluster.extra_api("api-doomed"), cluster.apis[1]
    client = DuplexClient([doomed.base, survivor.base], heartbeat_s=None)
    await client.connect(REAL_TIME)
    try:
        pcm = await speak(client, 1.0)
        events = await client.until("response.output_audio.delta")
        events += await client.until("response.output_audio.delta")
        doomed.kill()  # mid-response, without a goodbye
        events += await client.until("rate_limits.updated", timeout=30)
        kinds = [e.wire_type for e in events]
        assert kinds.count("session.resumed") == 1 and client.resumes == 1
        assert kinds[-2:] == ["response.done", "rate_limits.updated"]
        assert client.wire_seqs == list(
            range(1, client.last_seq + 1)
        )  # contiguous, no gap, no duplicate
        audio = b"".join(
            base64.b64decode(e.delta)
            for e in events
            if e.wire_type == "response.output_audio.delta"
        )
        assert audio == expected_echo(pcm, 16000)
        transcript = next(
            e for e in events if e.wire_type == "response.output_audio_transcript.done"
        )
        assert transcript.transcript == "echo 1000 ms"
        resumed = next(e for e in events if e.wire_type == "session.resumed")
        assert resumed.attachment_generation == 2 and resumed.session_id == client.session_id
    finally:
        await client.close()


async def test_resume_after_a_dropped_socket_on_the_same_pod(cluster):
    client = DuplexClient([cluster.apis[0].base], heartbeat_s=None)
    await client.connect(REAL_TIME)
    try:
        await speak(client, 0.6)
        events = await client.until("response.output_audio.delta")
        await client.drop_connection()
        events += await client.until("rate_limits.updated")
        assert client.resumes == 1 and client.wire_seqs == list(range(1, client.last_seq + 1))
        assert "session.resumed" in [e.wire_type for e in events]
        await client.send({"type": "session.heartbeat"})
        assert (
            await client.recv()
        ).wire_type == "session.heartbeat_ack"  # commands flow after resume
    finally:
        await client.close()


def resume_request(session_id: str, token: str, last_seq: int) -> str:
    request = {
        "type": "session.resume",
        "session_id": session_id,
        "resume_token": token,
        "last_received_server_event_seq": last_seq,
    }
    return orjson.dumps(request).decode()


async def resume_reply(ws: websockets.ClientConnection) -> dict:
    async with asyncio.timeout(10):
        return orjson.loads(await ws.recv())


async def raw_resume(base: str, session_id: str, token: str, last_seq: int) -> dict:
    async with websockets.connect(realtime_url(base, resume=True)) as ws:
        await ws.send(resume_request(session_id, token, last_seq))
        return await resume_reply(ws)


async def test_concurrent_resumes_exactly_one_wins_and_the_old_socket_is_replaced(cluster):
    a, b = cluster.apis
    async with websockets.connect(realtime_url(a.base)) as old:
        await old.send('{"type":"session.update","session":{}}')
        created = orjson.loads(await old.recv())
        assert orjson.loads(await old.recv())["type"] == "session.updated"  # the open's second
        session_id, token = created["session"]["id"], created["resume_token"]
        # both resumes race on two pods; the winner's socket stays attached until both
        # are answered, so the loser meets a live attachment, whichever it is
        async with (
            websockets.connect(realtime_url(a.base, resume=True)) as via_a,
            websockets.connect(realtime_url(b.base, resume=True)) as via_b,
        ):
            request = resume_request(session_id, token, 0)
            await asyncio.gather(via_a.send(request), via_b.send(request))
            replies = await asyncio.gather(resume_reply(via_a), resume_reply(via_b))
        kinds = sorted(r["type"] for r in replies)
        assert kinds == ["error", "session.resumed"]
        error = next(r for r in replies if r["type"] == "error")
        assert error["error"]["code"] == "session_resume_conflict"
        replaced = orjson.loads(await asyncio.wait_for(old.recv(), 10))
        assert replaced == {
            **replaced,
            "type": "session.replaced",
            "session_id": session_id,
            "attachment_generation": 1,
        }
        await asyncio.wait_for(old.wait_closed(), 10)
        assert old.close_reason == "session_replaced"


async def test_resume_refusals(cluster):
    base = cluster.apis[0].base
    client = DuplexClient([base], heartbeat_s=None)
    await client.connect({"extra_body": {"pace": 0}})
    try:
        bad = await raw_resume(base, client.session_id, "not-the-token", 0)
        assert bad["error"]["code"] == "invalid_resume_token"
        unknown = await raw_resume(base, "duplex-" + "0" * 32, "x", 0)
        assert unknown["error"]["code"] == "session_resume_expired"
        # a seq past the head: events the store lost in a failover, to the server's eyes
        future = await raw_resume(base, client.session_id, client.resume_token, 10_000)
        assert (future["type"], future["reason"]) == ("session.resync_required", "journal_gap")
    finally:
        await client.close()


async def test_resume_of_a_closed_session_is_expired(cluster):
    client = DuplexClient([cluster.apis[0].base], heartbeat_s=None)
    await client.connect({"extra_body": {"pace": 0}})
    session_id, token = client.session_id, client.resume_token
    await client.close()
    reply = await raw_resume(cluster.apis[1].base, session_id, token, 0)
    assert reply["error"]["code"] == "session_resume_expired"
    try:
        reconnecting = DuplexClient([cluster.apis[1].base], heartbeat_s=None)
        reconnecting.session_id, reconnecting.resume_token = session_id, token
        await reconnecting._resume()
    except DuplexClientError as exc:
        assert exc.code == "session_resume_expired"
    else:
        raise AssertionError("a closed session must not resume")


async def test_a_worker_stops_cleanly_on_sigterm(cluster):
    from harness.processes import start_worker
    from shared.redis.connection import connect
    from shared.redis.keys import KeySchema

    keys = KeySchema(cluster.prefix)
    client = connect(cluster.redis_url).client
    worker = start_worker(cluster.redis_url, cluster.prefix, "worker-sigterm")
    try:
        for _ in range(600):  # a loaded 2-core CI machine can take a while to start it
            if await client.zscore(keys.workers(), "worker-sigterm") is not None:
                break
            await asyncio.sleep(0.1)
        assert await client.hget(keys.worker("worker-sigterm"), "model") == b"echo"
        assert worker.stop() == 0
        assert await client.zscore(keys.workers(), "worker-sigterm") is None  # deregistered
        assert await client.exists(keys.worker("worker-sigterm")) == 0
    finally:
        worker.kill()
        await client.aclose()


def test_a_sigterm_the_moment_a_worker_registers_drains_it(redis_server):
    """SIGTERM handling is installed before the worker registers: a SIGTERM sent the
    moment its registration is written (here by the worker itself, right after `start`)
    drains and deregisters it, not the default action (exit -15, left registered)."""
    import os
    import subprocess
    import sys
    import uuid

    prefix = f"sigterm-{uuid.uuid4().hex[:8]}"
    code = (
        "import os, signal, sys\n"
        "from services.worker.process import WorkerProcess\n"
        "start = WorkerProcess.start\n"
        "async def start_then_term(self):\n"
        "    await start(self)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "WorkerProcess.start = start_then_term\n"
        "from services.cli import main\n"
        "sys.argv = ['duplex', 'worker', '--plugin', 'echo', '--worker-id', 'w-term']\n"
        "main()\n"
    )
    env = {
        **os.environ,
        "DUPLEX_REDIS_URL": redis_server.url,
        "DUPLEX_KEY_PREFIX": prefix,
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import redis as redis_sync

    from shared.redis.keys import KeySchema

    client = redis_sync.Redis.from_url(redis_server.url)
    try:
        assert client.zscore(KeySchema(prefix).workers(), "w-term") is None
    finally:
        client.close()
