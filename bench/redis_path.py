"""Latency of the distributed path against the raw Redis floor, measured in one run.

Starts a real redis-server, one `duplex worker --plugin echo` and one
`duplex api`, then measures (sequentially, one client):
  floor      XADD waking a blocked XREAD on another connection (the physical floor)
  open       WebSocket connect + session.update -> session.created
  heartbeat  session.heartbeat -> session.heartbeat_ack on an open session
             (client -> API -> Redis inbox -> worker runner -> Redis publish -> API -> client)
Prints median / p99 / max and the ratio of each median to the floor's, and
writes them to docs/benchmarks.md (between its markers).

    .venv/bin/python -m bench.redis_path [--opens 100] [--events 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time
import uuid

import orjson
import redis.asyncio as redis_async
import websockets

from bench.common import summary, write_section
from harness.processes import start_api, start_worker
from harness.redis_server import RedisServer


async def redis_floor(url: str, n: int) -> list[float]:
    writer, reader = redis_async.Redis.from_url(url), redis_async.Redis.from_url(url)
    stream = f"bench:{uuid.uuid4().hex}"
    await writer.xadd(stream, {"f": "0"})
    samples = []
    for _ in range(n):
        last = (await writer.xrevrange(stream, count=1))[0][0]
        waiting = asyncio.create_task(reader.xread({stream: last}, block=0))
        await asyncio.sleep(0.001)  # the reader is blocked now
        started = time.perf_counter()
        await writer.xadd(stream, {"f": "1"})
        await waiting
        samples.append(time.perf_counter() - started)
    await writer.delete(stream)
    await writer.aclose()
    await reader.aclose()
    return samples


async def opens(base: str, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        async with websockets.connect(f"{base}/v1/realtime?duplex=1") as ws:
            await ws.send('{"type":"session.update","session":{"extra_body":{"pace":0}}}')
            created = orjson.loads(await ws.recv())
            samples.append(time.perf_counter() - started)
            assert created["type"] == "session.created", created
            await ws.send('{"type":"session.close"}')
            while orjson.loads(await ws.recv())["type"] != "session.closed":
                pass
    return samples


async def heartbeats(base: str, n: int) -> list[float]:
    samples = []
    async with websockets.connect(f"{base}/v1/realtime?duplex=1") as ws:
        await ws.send('{"type":"session.update","session":{}}')
        await ws.recv()  # session.created
        await ws.recv()  # session.updated
        for _ in range(n):
            started = time.perf_counter()
            await ws.send('{"type":"session.heartbeat"}')
            reply = orjson.loads(await ws.recv())
            samples.append(time.perf_counter() - started)
            assert reply["type"] == "session.heartbeat_ack", reply
    return samples


def render(results: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    floor = results["floor"]["median_ms"]
    rows = [
        "| measure | n | median ms | p99 ms | max ms | median / floor |",
        "|---|---|---|---|---|---|",
    ]
    labels = {
        "floor": "Redis floor: XADD wakes a blocked XREAD",
        "open": "open: connect + session.update -> session.created",
        "heartbeat": "event round trip: heartbeat -> heartbeat_ack",
    }
    for key, label in labels.items():
        r = results[key]
        rows.append(
            f"| {label} | {r['n']} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | {r['max_ms']:.3f} "
            f"| {r['median_ms'] / floor:.1f}x |"
        )
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return "\n".join(
        [
            f"Measured {when} on {platform.machine()}, Python {platform.python_version()}, "
            "one client, sequential:",
            f"`python -m bench.redis_path --opens {args.opens} --events {args.events}`",
            "(a real redis-server, one `duplex worker --plugin echo`, one `duplex api`).",
            "",
            *rows,
        ]
    )


async def main(args: argparse.Namespace) -> None:
    server = RedisServer()
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    worker = start_worker(server.url, prefix, "bench-worker")
    api = start_api(server.url, prefix, "bench-api")
    try:
        api.wait_ready()
        base = f"ws://127.0.0.1:{api.port}"
        await heartbeats(base, 50)  # warm-up
        results = {
            "floor": summary(await redis_floor(server.url, args.events)),
            "open": summary(await opens(base, args.opens)),
            "heartbeat": summary(await heartbeats(base, args.events)),
        }
    finally:
        api.stop()
        worker.stop()
        server.stop()
    table = render(results, args)
    print(table)
    heading = "The hot path, back to back (`bench/redis_path.py`)"
    write_section("benchmarks.md", "redis_path", table, heading)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opens", type=int, default=100)
    parser.add_argument("--events", type=int, default=1000)
    asyncio.run(main(parser.parse_args()))
