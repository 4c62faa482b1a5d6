"""How many real-time echo sessions one API process + one worker process carry.

    .venv/bin/python -m bench.capacity [--levels 10,20,40,60,80,100,120,160] [--step-seconds 8]

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
  Redis ops  commands Redis processed per second of session audio
The ramp stops at the first level where lateness p99 exceeds 20 ms or a process uses more
than 90% of a core; the sustained count is the last level before it. Writes
docs/benchmarks.md (section capacity) and docs/img/capacity.png.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import time

import orjson
import redis.asyncio as redis_async
import websockets

from bench.common import IMAGES, CpuMeter, Stack, machine, now_utc, percentile, write_section
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
    return Conversation(ws, speech, silence)


def window(pairs: list[tuple[float, float]], since: float) -> list[float]:
    return sorted(value for at, value in pairs if at >= since)


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
            while len(conversations) < level:
                conversations.append(await start_conversation(base, speech, silence))
            await asyncio.sleep(3.0)  # every new session has started a turn
            since = time.monotonic()
            ops_before = int((await redis.info("stats"))["total_commands_processed"])
            meter.start()
            await asyncio.sleep(step_s)
            cpu = meter.read()
            ops = int((await redis.info("stats"))["total_commands_processed"]) - ops_before
            late = sorted(v for c in conversations for v in window(c.lateness, since))
            first = sorted(v for c in conversations for v in window(c.first_delta, since))
            row = {
                "sessions": level,
                "deltas": len(late),
                "late_p50_ms": percentile(late, 0.5) * 1000 if late else float("nan"),
                "late_p99_ms": percentile(late, 0.99) * 1000 if late else float("nan"),
                "first_p50_ms": percentile(first, 0.5) * 1000 if first else float("nan"),
                "cpu": cpu,
                "redis_ops_per_audio_s": ops / (level * step_s),
                "errors": sum(len(c.errors) for c in conversations),
            }
            results.append(row)
            print(
                f"{level:4d} sessions: lateness p50 {row['late_p50_ms']:.1f} ms "
                f"p99 {row['late_p99_ms']:.1f} ms, first delta {row['first_p50_ms']:.1f} ms, "
                + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
                + f", {row['redis_ops_per_audio_s']:.0f} Redis ops/audio s, "
                f"{row['errors']} errors",
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


def plot(results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMAGES.mkdir(parents=True, exist_ok=True)
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
    cpu_ax.set_ylabel("CPU (cores busy)")
    cpu_ax.set_ylim(0, 1.05)
    lines = late_ax.get_legend_handles_labels()
    more = cpu_ax.get_legend_handles_labels()
    late_ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    late_ax.grid(alpha=0.3)
    fig.suptitle("capacity: one API process + one worker process + Redis")
    fig.tight_layout()
    fig.savefig(IMAGES / "capacity.png", dpi=100)
    plt.close(fig)


def render(results: list[dict], args: argparse.Namespace) -> str:
    rows = [
        "| sessions | deltas | lateness p50 ms | lateness p99 ms | commit -> 1st delta p50 ms "
        "| API CPU | worker CPU | Redis CPU | load gen. CPU | all CPU | Redis ops / audio s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        cpu = r["cpu"]
        rows.append(
            f"| {r['sessions']} | {r['deltas']} | {r['late_p50_ms']:.1f} | {r['late_p99_ms']:.1f} "
            f"| {r['first_p50_ms']:.1f} | {cpu['api']:.2f} | {cpu['worker']:.2f} "
            f"| {cpu['redis']:.2f} | {cpu['load generator']:.2f} | {sum(cpu.values()):.2f} "
            f"| {r['redis_ops_per_audio_s']:.0f} |"
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
    return "\n".join(
        [
            f"Measured {now_utc()} on {machine()}:",
            f"`python -m bench.capacity --levels {args.levels} --step-seconds {args.step_seconds}`",
            "",
            *rows,
            "",
            verdict,
            bottleneck,
            f"CPU per session (CPU-ms per wall second) at {top['sessions']} sessions: "
            f"{per_session}.",
            "",
            "![capacity curve](img/capacity.png)",
        ]
    )


async def main(args: argparse.Namespace) -> None:
    levels = [int(x) for x in args.levels.split(",")]
    env = {"DUPLEX_MAX_SESSIONS": str(max(levels) + 8)}
    with Stack(worker_env=env) as stack:
        results = await ramp(stack, levels, args.step_seconds)
    plot(results)
    table = render(results, args)
    print(table)
    write_section(
        "benchmarks.md", "capacity", table, "Capacity of one API + one worker (`bench/capacity.py`)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="10,20,40,60,80,100,120,160")
    parser.add_argument("--step-seconds", type=float, default=8.0)
    asyncio.run(main(parser.parse_args()))
