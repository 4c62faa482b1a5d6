"""What checkpointing costs a turn: Redis commands, round trips and bytes, as a session grows.

Starts a real redis-server, one `duplex worker --plugin echo` and one `duplex api`; one
client holds one session and speaks `--turns` echo turns (200 ms of audio in 20 ms appends,
a commit, the answer at full speed). Redis's own command counters (`INFO commandstats`,
which count the commands a Lua script runs too) give the commands per turn; the session
hash's `checkpoints` field the checkpoint writes; `STRLEN` of the checkpoint key its size
as the conversation grows. The floor, measured in the same run: the commands of one
heartbeat round trip, the cheapest thing a session does through Redis.

    .venv/bin/python -m bench.checkpoints [--turns 100] [--heartbeats 200]
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from typing import Any

import redis.asyncio as redis_async

from bench.common import machine, now_utc, write_section
from harness.processes import start_api, start_worker
from harness.redis_server import RedisServer
from harness.sessions import sine
from shared.client.duplex_client import DuplexClient
from shared.protocol.duplex import float_to_pcm16
from shared.redis.keys import KeySchema

SESSION = {
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
    "extra_body": {"pace": 0},
}
#: conversation lengths at which the checkpoint's size is reported
SIZE_AT = (1, 10, 50, 100, 200, 500)


async def commands(redis: redis_async.Redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


async def heartbeat_floor(client: DuplexClient, redis: redis_async.Redis, n: int) -> float:
    before = await commands(redis)
    for _ in range(n):
        await client.send({"type": "session.heartbeat"})
        await client.until("session.heartbeat_ack")
    spent = delta(await commands(redis), before)
    spent.pop("info", None)
    return sum(spent.values()) / n


async def turns(
    client: DuplexClient, redis: redis_async.Redis, keys: KeySchema, n: int
) -> dict[str, Any]:
    pcm = float_to_pcm16(sine(16_000, 0.2))
    sid = client.session_id
    before = await commands(redis)
    writes_before = int(await redis.hget(keys.session(sid), "checkpoints") or 0)
    sizes: dict[int, int] = {}
    for turn in range(1, n + 1):
        for i in range(0, len(pcm), 640):
            await client.append_audio(pcm[i : i + 640])
        await client.commit()
        await client.until("response.done")
        if turn in SIZE_AT:
            sizes[turn] = await redis.strlen(keys.checkpoint(sid))
    spent = delta(await commands(redis), before)
    spent.pop("info", None)
    writes = int(await redis.hget(keys.session(sid), "checkpoints") or 0) - writes_before
    return {
        "commands": sum(spent.values()) / n,
        "round_trips": (spent.get("evalsha", 0) + spent.get("eval", 0)) / n,
        "sets": spent.get("set", 0) / n,
        "writes": writes / n,
        "sizes": sizes,
        "final_size": await redis.strlen(keys.checkpoint(sid)),
    }


def render(floor: float, result: dict[str, Any], args: argparse.Namespace) -> str:
    sizes = ", ".join(f"{turn}: {size:,} B" for turn, size in result["sizes"].items())
    per_write = result["final_size"]
    rows = [
        "| measure | per turn |",
        "|---|---|",
        f"| Redis commands (all, Lua's included) | {result['commands']:.1f} "
        f"({result['commands'] / floor:.1f}x a heartbeat's {floor:.1f}) |",
        f"| checkpoint writes (`checkpoints` in the hash) | {result['writes']:.2f} |",
        f"| of the commands, the checkpoints' own (SET + HINCRBY in event_publish.lua) "
        f"| {2 * result['writes']:.1f} |",
        "| extra round trips for checkpoints | 0 (written in the events' own call) |",
        f"| checkpoint bytes written, at {args.turns} turns "
        f"| {result['writes'] * per_write:,.0f} |",
    ]
    return "\n".join(
        [
            f"Measured {now_utc()} on {machine()}:",
            f"`python -m bench.checkpoints --turns {args.turns} --heartbeats {args.heartbeats}`",
            "(a real redis-server, one echo worker, one API pod; one session, 200 ms turns "
            "in 20 ms appends).",
            "",
            *rows,
            "",
            f"Checkpoint size by conversation length (turns): {sizes}. It grows with the "
            "history (two items a turn, transcripts only), not with the audio.",
        ]
    )


async def main(args: argparse.Namespace) -> None:
    server = RedisServer()
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    keys = KeySchema(prefix)
    worker = start_worker(server.url, prefix, "bench-worker")
    api = start_api(server.url, prefix, "bench-api")
    redis = redis_async.Redis.from_url(server.url)
    try:
        api.wait_ready()
        client = DuplexClient([api.base], heartbeat_s=None)
        await client.connect(SESSION)
        await heartbeat_floor(client, redis, 20)  # warm-up
        floor = await heartbeat_floor(client, redis, args.heartbeats)
        result = await turns(client, redis, keys, args.turns)
        await client.close()
    finally:
        await redis.aclose()
        api.stop()
        worker.stop()
        server.stop()
    table = render(floor, result, args)
    print(table)
    write_section("benchmarks.md", "checkpoints", table, "What a checkpoint costs a turn")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--heartbeats", type=int, default=200)
    asyncio.run(main(parser.parse_args()))
