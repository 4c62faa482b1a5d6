"""Command latency through the whole distributed path at 1, 10, 50 and 200 sessions,
next to the raw Redis floor, the bare WebSocket floor and the in-process inline client, all
in one run.

    .venv/bin/python -m bench.latency [--levels 1,10,50,200] [--seconds 5]
                                      [--section latency] [--label TEXT] [--docs DIR]

For each level L (L sessions at once, each sending a command every 20 ms, the cadence of a
client's audio appends):
  floor      L pairs of connections: XADD waking a blocked XREAD (the physical floor)
  ws floor   session.heartbeat -> heartbeat_ack on the bare WebSocket process
             (`bench/bare_floor.py`: the API's server stack, no Redis), L sessions, same pacing
  composed   ws floor median + 2 x floor median: a command's unavoidable path (client ->
             API -> Redis -> worker, then worker -> Redis -> API -> client) with no work in
             the API or the worker; the heartbeat's median over it is the headline ratio
  inline     session.heartbeat -> heartbeat_ack on the in-process session host (no Redis,
             no WebSocket: the engine's own cost)
  heartbeat  the same through client -> API -> Redis -> worker runner -> Redis -> API -> client
  speech     append -> input_audio_buffer.speech_started (server VAD), measured from the
             append holding the onset the server reports, distributed and inline
Writes a table to docs/benchmarks.md (section `latency`, or `--section`) and a plot to
docs/img/<section>.png; `--docs` writes into another docs/ (a clone of an older commit
records its "before" figures into this checkout's docs).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import math
import random
import time
import uuid
from pathlib import Path

import numpy as np
import orjson
import redis.asyncio as redis_async
import websockets

from bench.bare_floor import BareFloorProcess
from bench.common import (
    DOCS,
    Stack,
    add_output_arguments,
    commit,
    machine,
    now_utc,
    summary,
    write_section,
)
from harness.sessions import speech_wav
from plugins.echo import EchoPlugin
from services.worker.control.manager import SessionManager
from shared.client.inline import InlineDuplexClient, InlineEventRouter
from shared.contracts import SessionRuntimeConfig
from shared.protocol.duplex import float_to_pcm16

CADENCE_S = 0.02
VAD = {"turn_detection": {"type": "server_vad", "create_response": False}}
SILENCE_S = 0.3
# Server VAD defaults: speech_started reports audio_start_ms = the first speech window minus
# prefix_padding_ms, after min_speech_duration_ms of speech, decided on 32 ms windows.
PREFIX_PADDING_MS, MIN_SPEECH_MS, WINDOW_MS = 300, 96, 32


async def paced(seconds: float, once: callable) -> list[float]:
    """Call `once` every ~20 ms (jittered so sessions do not march in step) for `seconds`."""
    samples: list[float] = []
    await asyncio.sleep(random.uniform(0, CADENCE_S))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        samples.append(await once())
        await asyncio.sleep(CADENCE_S * random.uniform(0.5, 1.5))
    return samples


async def floor_level(url: str, sessions: int, seconds: float) -> list[float]:
    client = redis_async.Redis.from_url(url, max_connections=2 * sessions + 4)

    async def pair() -> list[float]:
        stream = f"bench:floor:{uuid.uuid4().hex}"
        last = await client.xadd(stream, {"f": "0"})

        async def once() -> float:
            nonlocal last
            waiting = asyncio.create_task(client.xread({stream: last}, block=0))
            await asyncio.sleep(0.002)  # the reader is blocked now
            started = time.perf_counter()
            await client.xadd(stream, {"f": "1"})
            reply = await waiting
            elapsed = time.perf_counter() - started
            last = reply[0][1][-1][0]
            return elapsed

        try:
            return await paced(seconds, once)
        finally:
            await client.delete(stream)

    results = await asyncio.gather(*(pair() for _ in range(sessions)))
    await client.aclose()
    return [s for r in results for s in r]


async def ws_session(base: str, session: dict) -> websockets.ClientConnection:
    ws = await websockets.connect(f"{base}/v1/realtime?duplex=1", max_size=None)
    await ws.send(orjson.dumps({"type": "session.update", "session": session}).decode())
    created = orjson.loads(await ws.recv())
    assert created["type"] == "session.created", created
    updated = orjson.loads(await ws.recv())  # session.updated follows it
    assert updated["type"] == "session.updated", updated
    return ws


async def ws_close(ws: websockets.ClientConnection) -> None:
    """End the session (a bare socket close would leave it detached, holding its slot)."""
    await ws.send('{"type":"session.close"}')
    await ws_until(ws, "session.closed")
    await ws.close()


async def ws_until(ws: websockets.ClientConnection, wire_type: str) -> dict:
    while True:
        event = orjson.loads(await ws.recv())
        if event["type"] == wire_type:
            return event
        if event["type"] == "error":
            raise RuntimeError(event)


async def distributed_heartbeats(bases: list[str], sessions: int, seconds: float) -> list[float]:
    sockets = await asyncio.gather(*(ws_session(bases[0], {}) for _ in range(sessions)))

    async def run(ws: websockets.ClientConnection) -> list[float]:
        async def once() -> float:
            started = time.perf_counter()
            await ws.send('{"type":"session.heartbeat"}')
            await ws_until(ws, "session.heartbeat_ack")
            return time.perf_counter() - started

        return await paced(seconds, once)

    results = await asyncio.gather(*(run(ws) for ws in sockets))
    await asyncio.gather(*(ws_close(ws) for ws in sockets))
    return [s for r in results for s in r]


def speech_appends() -> tuple[list[bytes], int]:
    """0.3 s of silence then the test utterance, as 20 ms pcm16 16 kHz appends."""
    speech, rate = speech_wav()
    audio = np.concatenate([np.zeros(int(SILENCE_S * rate), np.float32), speech[:rate]])
    pcm = float_to_pcm16(audio)
    step = rate // 50 * 2
    return [pcm[i : i + step] for i in range(0, len(pcm), step)], rate


async def speech_onsets(send, receive_started, sessions: int) -> list[float]:
    """Stream the utterance in real time on every session; time from the append that gave the
    VAD the last window it needed (onset + min speech, rounded up to a window) to
    speech_started."""
    chunks, _ = speech_appends()

    async def run(index: int) -> float:
        sent_at: list[float] = []
        await asyncio.sleep(random.uniform(0, CADENCE_S))
        started_task = asyncio.create_task(receive_started(index))
        begin = time.monotonic()
        for n, chunk in enumerate(chunks):
            await asyncio.sleep(max(0.0, begin + n * CADENCE_S - time.monotonic()))
            sent_at.append(time.perf_counter())
            await send(index, chunk)
            if started_task.done():
                break
        start_ms, arrived = await started_task
        evidence_ms = start_ms + PREFIX_PADDING_MS + MIN_SPEECH_MS
        decided_ms = math.ceil(evidence_ms / WINDOW_MS) * WINDOW_MS
        return arrived - sent_at[min(len(sent_at) - 1, math.ceil(decided_ms / 20) - 1)]

    return list(await asyncio.gather(*(run(i) for i in range(sessions))))


async def distributed_speech(bases: list[str], sessions: int) -> list[float]:
    sockets = await asyncio.gather(*(ws_session(bases[0], VAD) for _ in range(sessions)))

    async def send(index: int, chunk: bytes) -> None:
        audio = base64.b64encode(chunk).decode()
        await sockets[index].send(f'{{"type":"input_audio_buffer.append","audio":"{audio}"}}')

    async def receive_started(index: int) -> tuple[float, float]:
        event = await ws_until(sockets[index], "input_audio_buffer.speech_started")
        return event["audio_start_ms"], time.perf_counter()

    try:
        return await speech_onsets(send, receive_started, sessions)
    finally:
        await asyncio.gather(*(ws_close(ws) for ws in sockets))


def inline_client(sessions: int) -> tuple[SessionManager, InlineDuplexClient]:
    router = InlineEventRouter()
    manager = SessionManager(EchoPlugin(), SessionRuntimeConfig(max_sessions=sessions), router)
    return manager, InlineDuplexClient(manager, router)


async def inline_heartbeats(sessions: int, seconds: float) -> list[float]:
    manager, client = inline_client(sessions)
    opened = [await client.open({}) for _ in range(sessions)]

    async def run(session) -> list[float]:
        async def once() -> float:
            started = time.perf_counter()
            await session.send({"type": "session.heartbeat"})
            await session.until("session.heartbeat_ack")
            return time.perf_counter() - started

        return await paced(seconds, once)

    results = await asyncio.gather(*(run(s) for s in opened))
    await manager.shutdown()
    return [s for r in results for s in r]


async def inline_speech(sessions: int) -> list[float]:
    manager, client = inline_client(sessions)
    opened = [await client.open(VAD) for _ in range(sessions)]

    async def send(index: int, chunk: bytes) -> None:
        audio = base64.b64encode(chunk).decode()
        await opened[index].send({"type": "input_audio_buffer.append", "audio": audio})

    async def receive_started(index: int) -> tuple[float, float]:
        events = await opened[index].until("input_audio_buffer.speech_started")
        return events[-1].audio_start_ms, time.perf_counter()

    try:
        return await speech_onsets(send, receive_started, sessions)
    finally:
        await manager.shutdown()


def composed_floor_ms(measures: dict[str, dict]) -> float:
    """One WebSocket round trip plus two Redis wakes (medians): the path with no work in it."""
    return measures["ws_floor"]["median_ms"] + 2 * measures["floor"]["median_ms"]


def render(results: dict[int, dict[str, dict]], args: argparse.Namespace) -> str:
    single_floor = results[min(results)]["floor"]["median_ms"]
    rows = [
        "| sessions | measure | n | median ms | p99 ms | max ms | median / floor at L "
        "| median / floor at 1 | median / composed floor at L |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    labels = {
        "floor": "Redis floor (XADD wakes XREAD)",
        "ws_floor": "bare WebSocket floor: heartbeat -> ack",
        "inline": "inline: heartbeat -> ack",
        "heartbeat": "distributed: heartbeat -> ack",
        "speech_inline": "inline: append -> speech_started",
        "speech": "distributed: append -> speech_started",
    }
    headline = []
    for level, measures in results.items():
        floor = measures["floor"]["median_ms"]
        composed = composed_floor_ms(measures)
        for key, label in labels.items():
            r = measures[key]
            rows.append(
                f"| {level} | {label} | {r['n']} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} "
                f"| {r['max_ms']:.3f} | {r['median_ms'] / floor:.1f}x "
                f"| {r['median_ms'] / single_floor:.1f}x | {r['median_ms'] / composed:.1f}x |"
            )
            if key == "ws_floor":
                rows.append(
                    f"| {level} | composed floor: WebSocket + 2 Redis wakes | - "
                    f"| {composed:.3f} | - | - | {composed / floor:.1f}x "
                    f"| {composed / single_floor:.1f}x | 1.0x |"
                )
        ratio = measures["heartbeat"]["median_ms"] / composed
        headline.append(f"{ratio:.1f}x at {level}")
    command = f"python -m bench.latency --levels {args.levels} --seconds {args.seconds}"
    if args.section != "latency":
        command += f" --section {args.section}"
    if args.label:
        command += f' --label "{args.label}"'
    return "\n".join(
        [
            f"Measured {now_utc()} on {machine()}, code at commit {commit()}"
            + (f" ({args.label})" if args.label else "")
            + ":",
            f"`{command}`",
            "(one redis-server, one `duplex worker --plugin echo`, one `duplex api`, and the",
            "bare WebSocket floor process; the load generator is another Python process on",
            "the same cores). Each session sends one command every 20 ms (jittered); the",
            "speech rows stream 0.3 s of silence then speech in real time, once per session.",
            "",
            "**Heartbeat round trip median over the composed floor (one bare WebSocket round",
            f"trip + two XADD-wakes-XREAD hops, same run): {', '.join(headline)} sessions.**",
            "",
            *rows,
            "",
            f"![latency distribution](img/{args.section}.png)",
        ]
    )


def plot(raw: dict[int, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    levels = sorted(raw)
    fig, axes = plt.subplots(1, len(levels), figsize=(4 * len(levels), 3.6), sharey=True)
    for ax, level in zip(np.atleast_1d(axes), levels, strict=True):
        for key, label, color in (
            ("floor", "Redis floor", "tab:gray"),
            ("ws_floor", "WebSocket floor", "black"),
            ("inline", "inline", "tab:green"),
            ("heartbeat", "distributed", "tab:blue"),
        ):
            values = np.sort(np.asarray(raw[level][key]) * 1000)
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=label, c=color)
        ax.set_xscale("log")
        ax.set_title(f"{level} session{'s' if level > 1 else ''}")
        ax.set_xlabel("round trip (ms, log)")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("fraction of commands")
    np.atleast_1d(axes)[0].legend(loc="lower right")
    fig.suptitle("heartbeat -> ack round trip vs the Redis and WebSocket floors (CDF)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def main(args: argparse.Namespace) -> None:
    levels = [int(x) for x in args.levels.split(",")]
    top = max(levels)
    results: dict[int, dict[str, dict]] = {}
    raw: dict[int, dict[str, list[float]]] = {}
    env = {"DUPLEX_MAX_SESSIONS": str(top + 8)}
    with Stack(worker_env=env) as stack, BareFloorProcess() as bare:
        bases = stack.ws_bases()
        await distributed_heartbeats(bases, 4, 1.0)  # warm-up: connections, VAD model, caches
        await distributed_heartbeats([bare.ws_base], 4, 1.0)
        for level in levels:
            samples = {
                "floor": await floor_level(stack.url, level, args.seconds),
                "ws_floor": await distributed_heartbeats([bare.ws_base], level, args.seconds),
                "inline": await inline_heartbeats(level, args.seconds),
                "heartbeat": await distributed_heartbeats(bases, level, args.seconds),
                "speech_inline": await inline_speech(level),
                "speech": await distributed_speech(bases, level),
            }
            raw[level] = samples
            results[level] = {key: summary(values) for key, values in samples.items()}
            print(level, {k: round(v["median_ms"], 3) for k, v in results[level].items()})
            await asyncio.sleep(1.0)  # let closed sessions drain before the next level
    table = render(results, args)
    print(table)
    docs = args.docs or DOCS
    plot(raw, docs / "img" / f"{args.section}.png")
    heading = "Latency under load (`bench/latency.py`)"
    if args.label:
        heading += f", {args.label}"
    write_section("benchmarks.md", args.section, table, heading, docs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,10,50,200")
    parser.add_argument("--seconds", type=float, default=5.0)
    add_output_arguments(parser, "latency")
    asyncio.run(main(parser.parse_args()))
