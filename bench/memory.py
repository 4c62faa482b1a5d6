"""Memory per session: 1000 idle sessions, and sessions whose resume journal is at its cap.

    .venv/bin/python -m bench.memory [--sessions 1000] [--full 4]

idle  open `sessions` sessions (default config: no server VAD) through one API pod to one
      echo worker and leave them idle, in `steps` equal steps; RSS growth per session of
      the API and worker processes, and Redis `used_memory` growth per session (session
      hash, lease, empty journal, inbox entries)
full  `full` more sessions each stream echo audio (pace 0) without acknowledging events
      until their journal reaches the default cap (8 MiB); Redis `used_memory` growth per
      such session, next to the cap itself
Writes docs/benchmarks.md (section memory).

How RSS is read per session: nothing can collect garbage or trim the heap inside the
measured processes from here, and RSS grows in allocator steps (pymalloc arenas, heap
top), so one reading after a few sessions says little. The figure is the least-squares
slope of RSS over the session count, read from /proc after each step (0, n/4, ... n
sessions, each step settled for 2 s): the marginal cost of one more idle session, with
the pod's one-off growth (caches, a first arena) left out. The plain (after - before) / n
is printed next to it; with 1000 sessions the two agree within about 1 KiB.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import resource

import orjson
import redis.asyncio as redis_async
import websockets

from bench.common import Stack, machine, now_utc, rss_bytes, write_section
from harness.sessions import sine
from shared.contracts import SessionRuntimeConfig
from shared.protocol.duplex import float_to_pcm16
from shared.redis.keys import KeySchema

MIB = 1024 * 1024
FAST = {"extra_body": {"pace": 0}}


async def open_session(base: str, session: dict) -> tuple[websockets.ClientConnection, str]:
    ws = await websockets.connect(f"{base}/v1/realtime?duplex=1", max_size=None)
    await ws.send(orjson.dumps({"type": "session.update", "session": session}).decode())
    created = orjson.loads(await ws.recv())
    assert created["type"] == "session.created", created
    updated = orjson.loads(await ws.recv())  # session.updated follows it
    assert updated["type"] == "session.updated", updated
    return ws, created["session"]["id"]


async def drain(ws: websockets.ClientConnection, wire_type: str) -> None:
    while orjson.loads(await ws.recv())["type"] != wire_type:
        pass


async def fill_to_cap(base: str, redis: redis_async.Redis, keys: KeySchema, cap: int) -> None:
    """Echo 1 s turns until the journal's byte count stops growing at the cap."""
    ws, sid = await open_session(base, FAST)
    second = base64.b64encode(float_to_pcm16(sine(16000, 1.0))).decode()
    while True:
        for _ in range(10):
            await ws.send(f'{{"type":"input_audio_buffer.append","audio":"{second}"}}')
        await ws.send('{"type":"input.commit"}')
        await drain(ws, "response.done")
        size = sum(len(fields[b"data"]) for _, fields in await redis.xrange(keys.events(sid)))
        if size > cap * 0.97:
            return


def slope(xs: list[int], ys: list[int]) -> float:
    """Least-squares slope of ys over xs (bytes per session)."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


async def used_memory(redis: redis_async.Redis) -> int:
    return int((await redis.info("memory"))["used_memory"])


async def main(args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 1000 sockets here and in the API
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    cap = SessionRuntimeConfig().resume_replay_max_bytes_per_session
    env = {"DUPLEX_MAX_SESSIONS": str(args.sessions + args.full + 16)}
    api_env = {"DUPLEX_LIMIT_CONCURRENCY": str(args.sessions + args.full + 64)}
    with Stack(worker_env=env, api_env=api_env) as stack:
        base = stack.ws_bases()[0]
        keys = KeySchema(stack.prefix)
        redis = redis_async.Redis.from_url(stack.url)
        api, worker = stack.apis[0].process.pid, stack.workers[0].process.pid
        warm = [await open_session(base, {}) for _ in range(20)]  # allocators, caches, imports
        for ws, _ in warm:
            await ws.send('{"type":"session.close"}')
            await drain(ws, "session.closed")
            await ws.close()
        # every close was answered above; this is time for freed memory to settle, not an
        # ordering of events
        await asyncio.sleep(1.0)
        pids = {"api": api, "worker": worker}
        redis_before = await used_memory(redis)
        counts, readings = [0], [{name: rss_bytes(pid) for name, pid in pids.items()}]
        sockets = []
        for step in range(1, args.steps + 1):
            target = args.sessions * step // args.steps
            while len(sockets) < target:
                batch = range(min(50, target - len(sockets)))
                sockets += await asyncio.gather(*(open_session(base, {}) for _ in batch))
            await asyncio.sleep(2.0)  # heartbeats, load reports, lazy allocations settle
            counts.append(len(sockets))
            readings.append({name: rss_bytes(pid) for name, pid in pids.items()})
        before, after = readings[0], readings[-1]
        redis_idle = await used_memory(redis)
        for _ in range(args.full):
            await fill_to_cap(base, redis, keys, cap)
        redis_full = await used_memory(redis)
        await redis.aclose()
        for ws, _ in sockets:
            await ws.close()
    n = args.sessions
    per = {name: slope(counts, [r[name] for r in readings]) for name in before}
    plain = {name: (after[name] - before[name]) / n for name in before}
    redis_per_idle = (redis_idle - redis_before) / n
    redis_per_full = (redis_full - redis_idle) / max(1, args.full)
    rows = [
        "| process | before MiB | with sessions MiB | per session |",
        "|---|---|---|---|",
        *(
            f"| {name} RSS ({n} idle sessions) | {before[name] / MIB:.1f} | "
            f"{after[name] / MIB:.1f} | {per[name] / 1024:.1f} KiB "
            f"(plain difference / n: {plain[name] / 1024:.1f} KiB) |"
            for name in ("api", "worker")
        ),
        f"| Redis used_memory ({n} idle sessions) | {redis_before / MIB:.1f} | "
        f"{redis_idle / MIB:.1f} | {redis_per_idle / 1024:.1f} KiB |",
        f"| Redis used_memory (+{args.full} sessions, journal at its {cap // MIB} MiB cap) | "
        f"{redis_idle / MIB:.1f} | {redis_full / MIB:.1f} | {redis_per_full / MIB:.2f} MiB |",
    ]
    table = "\n".join(
        [
            f"Measured {now_utc()} on {machine()}:",
            f"`python -m bench.memory --sessions {n} --full {args.full} --steps {args.steps}`",
            "(a real redis-server, one echo worker, one API pod, every session on its own",
            "WebSocket; RSS from /proc, per session the least-squares slope of RSS over",
            f"{args.steps} equal steps of sessions (counts {', '.join(map(str, counts))});",
            "Redis from INFO memory).",
            "",
            *rows,
        ]
    )
    print(table)
    write_section("benchmarks.md", "memory", table, "Memory per session (`bench/memory.py`)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--full", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="RSS read after each of these")
    asyncio.run(main(parser.parse_args()))
