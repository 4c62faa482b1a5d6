"""Open and resume latency: session.update -> session.created, and reconnect ->
session.resumed + the replay of 100 journaled events.

    .venv/bin/python -m bench.lifecycle [--runs 100]

open    connect a WebSocket, send session.update, time until session.created; then the
        session is closed (session.close -> session.closed), sequentially, `runs` times
resume  a session streams echo responses (pace 0) until its journal holds more than 100
        events; the client drops its socket and times: connect (to the *other* API pod),
        session.resume with last_received_server_event_seq = head - 100, until
        session.resumed and all 100 replayed events have arrived
The Redis floor (XADD waking a blocked XREAD) is measured in the same run. Writes
docs/benchmarks.md (section lifecycle).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import time

import orjson
import websockets

from bench.common import Stack, machine, now_utc, summary, write_section
from bench.redis_path import redis_floor
from harness.sessions import sine
from shared.protocol.duplex import float_to_pcm16

REPLAY = 100
FAST = {"extra_body": {"pace": 0}}


async def recv(ws: websockets.ClientConnection) -> dict:
    async with asyncio.timeout(30):
        return orjson.loads(await ws.recv())


async def until(ws: websockets.ClientConnection, wire_type: str) -> list[dict]:
    events = []
    while True:
        events.append(await recv(ws))
        if events[-1]["type"] == wire_type:
            return events


async def close_session(ws: websockets.ClientConnection) -> None:
    await ws.send('{"type":"session.close"}')
    await until(ws, "session.closed")
    await ws.close()


async def opens(base: str, runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        ws = await websockets.connect(f"{base}/v1/realtime?duplex=1")
        await ws.send(orjson.dumps({"type": "session.update", "session": FAST}).decode())
        created = await recv(ws)
        samples.append(time.perf_counter() - started)
        assert created["type"] == "session.created", created
        await close_session(ws)
    return samples


async def fill_journal(ws: websockets.ClientConnection) -> int:
    """Echo turns until more than REPLAY events were journaled; returns the head seq."""
    pcm = float_to_pcm16(sine(16000, 1.0))
    head = 0
    while head <= REPLAY + 1:
        for i in range(0, len(pcm), 640):
            audio = base64.b64encode(pcm[i : i + 640]).decode()
            await ws.send(f'{{"type":"input_audio_buffer.append","audio":"{audio}"}}')
        await ws.send('{"type":"input.commit"}')
        for event in await until(ws, "response.done"):
            head = max(head, event.get("server_event_seq") or 0)
    return head


async def resume_once(bases: list[str]) -> float:
    ws = await websockets.connect(f"{bases[0]}/v1/realtime?duplex=1", max_size=None)
    await ws.send(orjson.dumps({"type": "session.update", "session": FAST}).decode())
    created = await recv(ws)
    session_id, token = created["session"]["id"], created["resume_token"]
    head = await fill_journal(ws)
    await ws.close()  # dropped: the session stays, detached or about to be

    started = time.perf_counter()
    ws = await websockets.connect(f"{bases[-1]}/v1/realtime?duplex=1&autostart=0", max_size=None)
    request = {
        "type": "session.resume",
        "session_id": session_id,
        "resume_token": token,
        "last_received_server_event_seq": head - REPLAY,
    }
    await ws.send(orjson.dumps(request).decode())
    resumed = await recv(ws)
    assert resumed["type"] == "session.resumed", resumed
    seqs = [(await recv(ws)).get("server_event_seq") for _ in range(REPLAY)]
    elapsed = time.perf_counter() - started
    assert seqs == list(range(head - REPLAY + 1, head + 1)), seqs
    await close_session(ws)
    return elapsed


async def main(args: argparse.Namespace) -> None:
    with Stack(apis=2) as stack:
        bases = stack.ws_bases()
        await opens(bases[0], 5)  # warm-up
        floor = summary(await redis_floor(stack.url, 1000))
        open_stats = summary(await opens(bases[0], args.runs))
        resume_stats = summary([await resume_once(bases) for _ in range(args.runs)])
    rows = [
        "| measure | n | median ms | p99 ms | max ms | median / floor |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in (
        ("Redis floor: XADD wakes a blocked XREAD", floor),
        ("open: connect + session.update -> session.created", open_stats),
        (f"resume on the other pod: connect -> session.resumed + {REPLAY} replayed", resume_stats),
    ):
        rows.append(
            f"| {label} | {r['n']} | {r['median_ms']:.3f} | {r['p99_ms']:.3f} | "
            f"{r['max_ms']:.3f} | {r['median_ms'] / floor['median_ms']:.1f}x |"
        )
    table = "\n".join(
        [
            f"Measured {now_utc()} on {machine()}:",
            f"`python -m bench.lifecycle --runs {args.runs}` (a real redis-server, one echo",
            "worker, two API pods; one client, sequential; the replayed events are the",
            "journal's last 100: audio deltas, transcripts and response lifecycle events).",
            "",
            *rows,
        ]
    )
    print(table)
    write_section("benchmarks.md", "lifecycle", table, "Open and resume (`bench/lifecycle.py`)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    asyncio.run(main(parser.parse_args()))
