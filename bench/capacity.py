"""How many real-time echo sessions one API process + one worker process carry, and what
each costs over the bare WebSocket floor.

    .venv/bin/python -m bench.capacity [--levels 10,20,40,60,80,100,120,160] [--step-seconds 8]
                                       [--floor-frames deltas|wire] [--section capacity]
                                       [--label TEXT] [--docs DIR]

Every session is a full-duplex conversation in real time: its microphone never stops
(20 ms pcm16 16 kHz appends, paced by the clock), it speaks for 2 s and commits
(`input.commit`), the echo model answers with the same 2 s in 100 ms audio deltas paced in
real time while the microphone keeps streaming (silence), and once the answer is done the
client clears the input buffer and speaks again. Sessions are added level by level and
kept; at each level, over `step-seconds`:
  lateness   for every audio delta, its arrival minus when it was due (the first delta of
             its response plus 100 ms per delta before it); p50/p99
  first      input.commit -> first audio delta
  CPU        cores busy in the API, the worker, Redis and this load generator
  Redis ops  commands Redis processed per second of session audio, and the most called
             ones (INFO commandstats, reset with CONFIG RESETSTAT before each window)
The ramp stops at the first level where lateness p99 exceeds 20 ms or a process uses more
than 90% of a core; the sustained count is the last level before it. Then, in the same run
and with the stack stopped, the same conversations (same frames, same windows) run against
the bare floor (`bench/bare_floor.py`: the API's WebSocket server stack answering with the
same deltas, nothing else) at every level the stack reached; the headline is API/floor and
worker/floor, CPU per session over the floor's. Writes docs/benchmarks.md (section
`capacity`, or `--section`) and docs/img/<section>.png; `--docs` writes into another docs/
(a clone of an older commit records its "before" figures into this checkout's docs).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import time
from pathlib import Path

import orjson
import redis.asyncio as redis_async
import websockets

from bench.bare_floor import FRAMES, BareFloorProcess
from bench.common import (
    DOCS,
    CpuMeter,
    Stack,
    add_output_arguments,
    commit,
    machine,
    now_utc,
    percentile,
    write_section,
)
from bench.floor_costs import cost_table, headline, redis_commands, top_commands, top_rates
from harness.sessions import sine
from shared.protocol.duplex import float_to_pcm16

APPEND_S = 0.02
TURN_APPENDS = 100  # 2 s of speech per turn
DELTA_S = 0.1
LATE_P99_S = 0.020
SATURATED = 0.9
SESSION = {
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
    "extra_body": {"pace": 1},
}


def append_frames() -> tuple[list[str], str]:
    """Pre-encoded append events (the load generator must stay cheap): speech and silence."""
    pcm = float_to_pcm16(sine(16000, TURN_APPENDS * APPEND_S, hz=330))
    speech = [append_frame(pcm[i : i + 640]) for i in range(0, len(pcm), 640)]
    return speech, append_frame(bytes(640))


def append_frame(pcm: bytes) -> str:
    return f'{{"type":"input_audio_buffer.append","audio":"{base64.b64encode(pcm).decode()}"}}'


class Conversation:
    """One session: a paced microphone task and a reader measuring the answers."""

    def __init__(self, ws: websockets.ClientConnection, speech: list[str], silence: str) -> None:
        self.ws = ws
        self.speech, self.silence = speech, silence
        self.lateness: list[tuple[float, float]] = []  # (arrival, seconds late)
        self.first_delta: list[tuple[float, float]] = []  # (arrival, commit -> first delta)
        self.errors: list[dict] = []
        self._answer_done = asyncio.Event()
        self._committed_at = 0.0
        self._tasks = [asyncio.create_task(self._microphone()), asyncio.create_task(self._read())]

    async def _microphone(self) -> None:
        next_at = time.monotonic() + random.uniform(0, 2.0)  # sessions do not speak in step
        while True:
            for frame in self.speech:
                next_at += APPEND_S
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                await self.ws.send(frame)
            self._answer_done.clear()
            self._committed_at = time.monotonic()
            await self.ws.send('{"type":"input.commit"}')
            while not self._answer_done.is_set():  # the microphone keeps streaming
                next_at += APPEND_S
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                await self.ws.send(self.silence)
            await self.ws.send('{"type":"input_audio_buffer.clear"}')

    async def _read(self) -> None:
        first_at, count = 0.0, 0
        async for raw in self.ws:
            now = time.monotonic()
            kind = orjson.loads(raw)["type"]
            if kind == "response.output_audio.delta":
                if count == 0:
                    first_at = now
                    self.first_delta.append((now, now - self._committed_at))
                self.lateness.append((now, now - (first_at + count * DELTA_S)))
                count += 1
            elif kind == "response.done":
                count = 0
                self._answer_done.set()
            elif kind == "error":
                self.errors.append(orjson.loads(raw))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ws.close()


async def start_conversation(base: str, speech: list[str], silence: str) -> Conversation:
    ws = await websockets.connect(f"{base}/v1/realtime?duplex=1", max_size=None)
    await ws.send(orjson.dumps({"type": "session.update", "session": SESSION}).decode())
    created = orjson.loads(await ws.recv())
    assert created["type"] == "session.created", created
    updated = orjson.loads(await ws.recv())  # session.updated follows it
    assert updated["type"] == "session.updated", updated
    return Conversation(ws, speech, silence)


def window(pairs: list[tuple[float, float]], since: float) -> list[float]:
    return sorted(value for at, value in pairs if at >= since)


async def open_conversations(
    conversations: list[Conversation], base: str, level: int, speech: list[str], silence: str
) -> None:
    while len(conversations) < level:
        conversations.append(await start_conversation(base, speech, silence))
    await asyncio.sleep(3.0)  # every new session has started a turn


def answers(conversations: list[Conversation], since: float) -> dict:
    """Lateness and first-delta figures of the deltas that arrived since `since`."""
    late = sorted(v for c in conversations for v in window(c.lateness, since))
    first = sorted(v for c in conversations for v in window(c.first_delta, since))
    return {
        "deltas": len(late),
        "late_p50_ms": percentile(late, 0.5) * 1000 if late else float("nan"),
        "late_p99_ms": percentile(late, 0.99) * 1000 if late else float("nan"),
        "first_p50_ms": percentile(first, 0.5) * 1000 if first else float("nan"),
        "errors": sum(len(c.errors) for c in conversations),
    }


async def ramp(stack: Stack, levels: list[int], step_s: float) -> list[dict]:
    base = stack.ws_bases()[0]
    speech, silence = append_frames()
    redis = redis_async.Redis.from_url(stack.url)
    meter = CpuMeter(
        {
            "api": stack.apis[0].process.pid,
            "worker": stack.workers[0].process.pid,
            "redis": stack.redis_pid(),
            "load generator": os.getpid(),
        }
    )
    conversations: list[Conversation] = []
    results = []
    try:
        for level in levels:
            await open_conversations(conversations, base, level, speech, silence)
            since = time.monotonic()
            await redis.config_resetstat()
            meter.start()
            await asyncio.sleep(step_s)
            cpu = meter.read()
            calls = await redis_commands(redis)
            audio_s = level * step_s
            row = {
                "sessions": level,
                **answers(conversations, since),
                "cpu": cpu,
                "redis_ops_per_audio_s": sum(calls.values()) / audio_s,
                "redis_top": top_rates(calls, audio_s),
            }
            results.append(row)
            print(
                f"{level:4d} sessions: lateness p50 {row['late_p50_ms']:.1f} ms "
                f"p99 {row['late_p99_ms']:.1f} ms, first delta {row['first_p50_ms']:.1f} ms, "
                + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
                + f", {row['redis_ops_per_audio_s']:.0f} Redis ops/audio s "
                f"({top_commands(row)}), {row['errors']} errors",
                flush=True,
            )
            saturated = [k for k, v in cpu.items() if v > SATURATED]
            if row["late_p99_ms"] > LATE_P99_S * 1000 or saturated or row["errors"]:
                row["stopped_by"] = (
                    f"{', '.join(saturated)} above {SATURATED:.0%} of a core"
                    if saturated
                    else "errors"
                    if row["errors"]
                    else "lateness p99 above 20 ms"
                )
                break
    finally:
        await asyncio.gather(*(c.close() for c in conversations))
        await redis.aclose()
    return results


async def floor_ramp(floor: BareFloorProcess, levels: list[int], step_s: float) -> list[dict]:
    """The same ramp against the bare WebSocket floor: same conversations, same frames, same
    windows, no stop rule (it runs the levels the stack reached)."""
    speech, silence = append_frames()
    meter = CpuMeter({"floor": floor.process.pid, "load generator": os.getpid()})
    conversations: list[Conversation] = []
    results = []
    try:
        for level in levels:
            await open_conversations(conversations, floor.ws_base, level, speech, silence)
            since = time.monotonic()
            meter.start()
            await asyncio.sleep(step_s)
            row = {"sessions": level, "cpu": meter.read(), **answers(conversations, since)}
            results.append(row)
            print(
                f"{level:4d} sessions, bare floor: lateness p99 {row['late_p99_ms']:.1f} ms, "
                + ", ".join(f"{k} {v:.2f}" for k, v in row["cpu"].items()),
                flush=True,
            )
    finally:
        await asyncio.gather(*(c.close() for c in conversations))
    return results


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    sessions = [r["sessions"] for r in results]
    fig, late_ax = plt.subplots(figsize=(7, 4))
    late_ax.plot(sessions, [r["late_p99_ms"] for r in results], "o-", c="tab:red", label="p99")
    late_ax.plot(sessions, [r["late_p50_ms"] for r in results], "o--", c="tab:red", label="p50")
    late_ax.axhline(LATE_P99_S * 1000, c="tab:red", lw=0.8, ls=":")
    late_ax.set_xlabel("concurrent real-time echo sessions")
    late_ax.set_ylabel("audio delta lateness (ms)", color="tab:red")
    cpu_ax = late_ax.twinx()
    for name, color in (("api", "tab:blue"), ("worker", "tab:green"), ("redis", "tab:gray")):
        cpu_ax.plot(sessions, [r["cpu"][name] for r in results], "s-", c=color, label=name)
    floor = [r["floor"]["cpu"]["floor"] for r in results]
    cpu_ax.plot(sessions, floor, "s:", c="black", label="bare floor")
    cpu_ax.set_ylabel("CPU (cores busy)")
    cpu_ax.set_ylim(0, 1.05)
    lines = late_ax.get_legend_handles_labels()
    more = cpu_ax.get_legend_handles_labels()
    late_ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    late_ax.grid(alpha=0.3)
    fig.suptitle("capacity: one API process + one worker process + Redis, and the bare floor")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render(results: list[dict], args: argparse.Namespace) -> str:
    cost = cost_table(results)
    timing = [
        "| sessions | deltas | lateness p50 ms | lateness p99 ms | commit -> 1st delta p50 ms "
        "| floor lateness p99 ms | load gen. CPU (stack / floor) | all CPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cpu, floor = r["cpu"], r["floor"]
        timing.append(
            f"| {r['sessions']} | {r['deltas']} | {r['late_p50_ms']:.1f} "
            f"| {r['late_p99_ms']:.1f} | {r['first_p50_ms']:.1f} | {floor['late_p99_ms']:.1f} "
            f"| {cpu['load generator']:.2f} / {floor['cpu']['load generator']:.2f} "
            f"| {sum(cpu.values()):.2f} |"
        )
    last = results[-1]
    sustained = [r for r in results if "stopped_by" not in r]
    if "stopped_by" in last:
        verdict = (
            f"Sustained: **{sustained[-1]['sessions'] if sustained else 0} sessions**; "
            f"at {last['sessions']} the ramp stopped: {last['stopped_by']}."
        )
    else:
        verdict = f"Sustained: **{last['sessions']} sessions**, the top of the ramp (no limit hit)."
    top = sustained[-1] if sustained else last
    per_session = ", ".join(
        f"{name} {1000 * top['cpu'][name] / top['sessions']:.1f} ms"
        for name in ("api", "worker", "redis")
    )
    per_session += f", bare floor {1000 * top['floor']['cpu']['floor'] / top['sessions']:.1f} ms"
    busiest = max(("api", "worker", "redis"), key=lambda name: last["cpu"][name])
    cores = os.cpu_count() or 1
    used = sum(last["cpu"].values())
    bottleneck = (
        f"Bottleneck: at {last['sessions']} sessions all processes together kept "
        f"{used:.2f} of the {cores} cores busy"
        + (
            " (the machine is the limit, no single process reached a core); "
            if used > 0.8 * cores
            else "; "
        )
        + f"the busiest process is the {busiest} ({last['cpu'][busiest]:.2f} cores), the "
        "first to saturate a core of its own on a bigger machine."
    )
    command = f"python -m bench.capacity --levels {args.levels} --step-seconds {args.step_seconds}"
    if args.floor_frames != "deltas":
        command += f" --floor-frames {args.floor_frames}"
    if args.section != "capacity":
        command += f" --section {args.section}"
    if args.label:
        command += f' --label "{args.label}"'
    return "\n".join(
        [
            f"Measured {now_utc()} on {machine()}, code at commit {commit()}"
            + (f" ({args.label})" if args.label else "")
            + ":",
            f"`{command}`",
            "",
            headline(top) + ("" if sustained else " (No level was sustained: a lower bound.)"),
            "",
            *cost,
            "",
            *timing,
            "",
            verdict,
            bottleneck,
            f"CPU per session (CPU-ms per wall second) at {top['sessions']} sessions: "
            f"{per_session}.",
            "",
            f"![capacity curve](img/{args.section}.png)",
        ]
    )


async def main(args: argparse.Namespace) -> None:
    levels = [int(x) for x in args.levels.split(",")]
    env = {"DUPLEX_MAX_SESSIONS": str(max(levels) + 8)}
    with Stack(worker_env=env) as stack:
        results = await ramp(stack, levels, args.step_seconds)
    # the floor after the stack is gone: each measured with only its own load generator
    with BareFloorProcess(frames=args.floor_frames) as floor:
        floors = await floor_ramp(floor, [r["sessions"] for r in results], args.step_seconds)
    for row, floor_row in zip(results, floors, strict=True):
        row["floor"] = floor_row
    docs = args.docs or DOCS
    plot(results, docs / "img" / f"{args.section}.png")
    table = render(results, args)
    print(table)
    heading = "Capacity of one API + one worker (`bench/capacity.py`)"
    if args.label:
        heading += f", {args.label}"
    write_section("benchmarks.md", args.section, table, heading, docs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="10,20,40,60,80,100,120,160")
    parser.add_argument("--step-seconds", type=float, default=8.0)
    parser.add_argument(
        "--floor-frames",
        choices=FRAMES,
        default="deltas",
        help="what the bare floor sends a turn: the deltas and the done (default), or every "
        "event the real path sends (bench/bare_floor.py --frames)",
    )
    add_output_arguments(parser, "capacity")
    asyncio.run(main(parser.parse_args()))
