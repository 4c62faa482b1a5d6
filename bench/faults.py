"""How long faults take to be noticed, with the default heartbeat (1 s) and TTL (5 s).

    .venv/bin/python -m bench.faults [--runs 3]

worker loss   SIGKILL the only worker of a live session (no other worker can take it);
              time until its client holds error{worker_lost} (heartbeat TTL + one
              janitor tick)
failover      two workers; SIGKILL the one answering a session's turn (not restarted):
              time until the client holds response.done{failed, worker_lost}, and until
              the turn spoken again is answered by the other worker (the session goes on
              from its checkpoint)
API pod loss  SIGKILL the API pod of a live session whose client does not
              reconnect; time until the session is detached (resumable
              elsewhere), and until session.expired is in its journal
              (DUPLEX_DISCONNECT_GRACE_S=5 here; 30 s by default)
Writes the figures to docs/benchmarks.md (between its markers).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import redis.asyncio as redis_async

from bench.common import write_section
from harness.processes import start_api, start_worker
from harness.redis_server import RedisServer
from harness.sessions import sine
from shared.client.duplex_client import DuplexClient
from shared.protocol.duplex import float_to_pcm16
from shared.redis.keys import KeySchema
from shared.redis.live_message import journal_entry_records

GRACE_S = 5.0


async def wait_for(predicate, timeout: float = 60.0) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if await predicate():
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    raise TimeoutError("the fault was not noticed")


async def worker_loss(server: RedisServer, runs: int) -> list[float]:
    samples = []
    prefix = f"bench-faults-{uuid.uuid4().hex[:6]}"
    api = start_api(server.url, prefix, "bench-api")
    try:
        for run in range(runs):
            worker = start_worker(server.url, prefix, f"bench-worker-{run}")
            api.wait_ready()
            client = DuplexClient([api.base], heartbeat_s=None)
            await client.connect({})
            worker.kill()
            started = time.monotonic()
            events = await client.until("error", timeout=60)
            samples.append(time.monotonic() - started)
            assert events[-1].code == "worker_lost"
            await client.close(end_session=False)
    finally:
        api.stop()
    return samples


async def worker_failover(server: RedisServer, runs: int) -> tuple[list[float], list[float]]:
    failed, answered = [], []
    prefix = f"bench-faults-{uuid.uuid4().hex[:6]}"
    keys = KeySchema(prefix)
    redis = redis_async.Redis.from_url(server.url)
    api = start_api(server.url, prefix, "bench-failover-api")
    workers = [start_worker(server.url, prefix, f"bench-failover-{i}") for i in range(2)]
    turn = float_to_pcm16(sine(16_000, 2.0))
    session = {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}
    try:
        api.wait_ready()
        for _ in range(runs):
            client = DuplexClient([api.base], heartbeat_s=None)
            await client.connect({**session, "extra_body": {"pace": 1}})
            owner = (await redis.hget(keys.session(client.session_id), "worker")).decode()
            for i in range(0, len(turn), 640):
                await client.append_audio(turn[i : i + 640])
            await client.commit()
            await client.until("response.output_audio.delta")  # answered in real time
            victim = next(w for w in workers if w.name == owner)
            victim.kill()
            started = time.monotonic()
            done = (await client.until("response.done", timeout=60))[-1]
            assert done.response["status"] == "failed", done.response
            failed.append(time.monotonic() - started)
            for i in range(0, len(turn) // 4, 640):  # the turn again, shorter
                await client.append_audio(turn[i : i + 640])
            await client.commit()
            done = (await client.until("response.done", timeout=60))[-1]
            assert done.response["status"] == "completed", done.response
            answered.append(time.monotonic() - started)
            await client.close()
            workers = [w for w in workers if w is not victim]
            workers.append(start_worker(server.url, prefix, f"{owner}-next"))
    finally:
        for worker in workers:
            worker.stop()
        api.stop()
        await redis.aclose()
    return failed, answered


async def api_loss(server: RedisServer, runs: int) -> tuple[list[float], list[float]]:
    detached, expired = [], []
    prefix = f"bench-faults-{uuid.uuid4().hex[:6]}"
    keys = KeySchema(prefix)
    client = redis_async.Redis.from_url(server.url)
    env = {"DUPLEX_DISCONNECT_GRACE_S": str(GRACE_S)}
    worker = start_worker(server.url, prefix, "bench-worker")
    survivor = start_api(server.url, prefix, "bench-survivor", **env)
    try:
        survivor.wait_ready()
        for run in range(runs):
            victim = start_api(server.url, prefix, f"bench-victim-{run}", **env)
            victim.wait_ready()
            session = DuplexClient([victim.base], heartbeat_s=None)
            await session.connect({})
            sid = session.session_id
            victim.kill()
            started = time.monotonic()

            async def is_detached(sid: str = sid) -> bool:
                return await client.hget(keys.session(sid), "state") in (
                    b"detached",
                    b"closing",
                    b"closed",
                )

            async def is_expired(sid: str = sid) -> bool:
                journal = await client.xrange(keys.events(sid))
                return any(
                    record.wire_type == "session.expired"
                    for entry in journal
                    for record in journal_entry_records(*entry)
                )

            await wait_for(is_detached)
            detached.append(time.monotonic() - started)
            await wait_for(is_expired)
            expired.append(time.monotonic() - started)
    finally:
        survivor.stop()
        worker.stop()
        await client.aclose()
    return detached, expired


def row(label: str, samples: list[float]) -> str:
    return (
        f"| {label} | {len(samples)} | {statistics.median(samples):.2f} | {min(samples):.2f} | "
        f"{max(samples):.2f} |"
    )


async def main(args: argparse.Namespace) -> None:
    server = RedisServer()
    try:
        lost = await worker_loss(server, args.runs)
        failed, answered = await worker_failover(server, args.runs)
        detached, expired = await api_loss(server, args.runs)
    finally:
        server.stop()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    table = "\n".join(
        [
            f"Measured {when}: `python -m bench.faults --runs {args.runs}`,",
            "heartbeat 1 s, heartbeat TTL 5 s, janitor tick 1 s.",
            "",
            "| fault -> noticed | runs | median s | min s | max s |",
            "|---|---|---|---|---|",
            row("worker SIGKILL, no other worker -> client has error{worker_lost}", lost),
            row("worker SIGKILL mid-response -> response.done failed (worker_lost)", failed),
            row("worker SIGKILL mid-response -> next turn answered elsewhere", answered),
            row("API pod SIGKILL -> session detached (resumable elsewhere)", detached),
            row(f"API pod SIGKILL -> session.expired (grace {GRACE_S:.0f} s)", expired),
        ]
    )
    print(table)
    write_section("benchmarks.md", "faults", table, "Fault detection (`bench/faults.py`)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
