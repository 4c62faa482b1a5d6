"""Where the time goes: sample the API and worker processes with py-spy under load.

    .venv/bin/python -m bench.profile [--load heartbeat|realtime] [--sessions 50]
                                      [--seconds 8] [--top 25] [--floor]

Runs the heartbeat load of `bench.latency` (each session one command every 20 ms) or the
real-time echo conversations of `bench.capacity` (`--load realtime`), and records both
processes with `py-spy record --format raw` (needs ptrace: root, or CAP_SYS_PTRACE), then
prints the CPU each process used and, per process, the functions holding the most samples,
by own time and by total time (frames on the stack). The raw stacks stay in
`$TMPDIR/duplex-profile-*.txt` for a flame graph. `--floor` runs the same load against the
bare WebSocket floor (`bench/bare_floor.py`) and records it instead: what the server stack
alone spends on these frames, the part of an API pod's profile no change of ours removes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bare_floor import BareFloorProcess
from bench.capacity import append_frames, start_conversation
from bench.common import CpuMeter, Stack, summary
from bench.latency import distributed_heartbeats


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy is missing: .venv/bin/pip install py-spy")
    return found


def record(pid: int, seconds: float, name: str) -> tuple[subprocess.Popen, Path]:
    out = Path(tempfile.mkstemp(prefix=f"duplex-profile-{name}-", suffix=".txt")[1])
    command = [py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds))]
    command += ["--rate", "250", "--format", "raw", "--output", str(out), "--nonblocking"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), out


def top_frames(raw: Path, top: int) -> list[str]:
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1] for f in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    lines = [f"  {samples} samples; own time:"]
    lines += [f"    {100 * n / samples:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines.append("  total time (on the stack):")
    lines += [f"    {100 * n / samples:5.1f}%  {frame}" for frame, n in total.most_common(top)]
    return lines


async def load(args: argparse.Namespace, bases: list[str]) -> str:
    """Run the chosen load for the recorded seconds; say what it was."""
    if args.load == "heartbeat":
        samples = await distributed_heartbeats(bases, args.sessions, args.seconds + 1)
        stats = summary(samples)
        return f"heartbeat median {stats['median_ms']:.3f} ms, p99 {stats['p99_ms']:.3f} ms"
    speech, silence = append_frames()
    talks = [await start_conversation(bases[0], speech, silence) for _ in range(args.sessions)]
    await asyncio.sleep(args.seconds + 1)
    await asyncio.gather(*(talk.close() for talk in talks))
    return "real-time echo conversations"


async def main(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as processes:
        if args.floor:
            floor = processes.enter_context(BareFloorProcess())
            bases, pids = [floor.ws_base], {"floor": floor.process.pid}
        else:
            env = {"DUPLEX_MAX_SESSIONS": str(args.sessions + 8)}
            stack = processes.enter_context(Stack(worker_env=env))
            bases = stack.ws_bases()
            pids = {
                "api": stack.apis[0].process.pid,
                "worker": stack.workers[0].process.pid,
                "redis": stack.redis_pid(),
            }
        await distributed_heartbeats(bases, 4, 1.0)
        meter = CpuMeter(pids)
        sampled = [name for name in pids if name != "redis"]
        recorders = {name: record(pids[name], args.seconds, name) for name in sampled}
        meter.start()
        figures = await load(args, bases)
        cpu = meter.read()
        for process, _ in recorders.values():
            process.wait(60)
    print(
        f"{args.sessions} sessions, {figures}; CPU (cores busy): "
        + ", ".join(f"{name} {value:.2f}" for name, value in cpu.items())
    )
    for name, (_, out) in recorders.items():
        print(f"\n{name} ({out}):")
        print("\n".join(top_frames(out, args.top)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", choices=["heartbeat", "realtime"], default="heartbeat")
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--floor", action="store_true", help="profile the bare WebSocket floor, not the stack"
    )
    asyncio.run(main(parser.parse_args()))
