"""How soon a model-native session speaks again after its worker goes, with real processes.

A real redis-server, one `duplex api` and two `duplex worker` of a tiny random model
(`--model moshi`: the moshi plugin on harness/tiny_moshi.py's checkpoint, greedy, run with
`.venv-moshi`; `--model nemotron`: the nemotron plugin on harness/tiny_nemotron.py's,
`device=cpu,threads=1`, run with `.venv-nemotron`); a duplex-surface client
(`/v1/realtime?duplex=1`) streams speech-like audio in real time (a tone, then quiet,
80 ms a chunk: what tests/e2e/native_moves.py streams, and what the tiny models answer)
for `--talk-s` seconds; then its worker is sent SIGKILL (a failover: the other worker sees
its heartbeat expire, takes the session and restores it from the model history as last
written) or SIGTERM (a drain: the worker hands the session over at once, its history
complete). Measured, for each move:

- from the move showing in Redis (the session hash's `worker` changing, `owner_generation`
  bumped; its time is the hash's `moved_at`, written by owner_move.lua) to the first
  model audio delta the client receives after it: **speaks again**;
- from the signal to the move (a failover's is the heartbeat TTL: 2 s here, as in the
  e2e tests; the default is 5 s), and for a drain from the old worker's `paused_at` (it
  stopped serving the session) to the first audio;
- the new worker's restore, as its log line says it (`restored (N frames replayed in S s,
  ...x real time, ...)`) and as the hash's `restore` field does (the JSON progress the
  worker writes; absent in code before bbb5b7d).

`--worker-tree LABEL=PATH` (repeatable) runs the API and the workers from another checkout
of the repository (PYTHONPATH=PATH; this venv's packages), e.g. the code before the tick
stage's replay scheduling (`git worktree add /tmp/before 1b76059`): every tree's figures
go in one table, measured in the same run. Writes the section `native_failover_<model>` of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.common import (
    DOCS,
    ROOT,
    add_output_arguments,
    commit,
    dirty,
    machine,
    now_utc,
    write_section,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = ("moshi", "nemotron")
VENVS = {"moshi": ".venv-moshi", "nemotron": ".venv-nemotron"}
OPTIONS = {
    "moshi": "device=cpu,temperature=0,temperature_text=0,threads=1",
    "nemotron": "device=cpu,threads=1",
}
#: a frame's record where the session hash does not say (`model_record_bytes`)
RECORD_BYTES = {"moshi": 12, "nemotron": 2702}
#: the targets: speaks again within this many seconds of the move showing in Redis
TARGET_S = {"moshi": 2.0, "nemotron": 6.0}
#: heartbeats as the e2e tests run them: a dead worker is seen in about 2 s
FAST = {"DUPLEX_HEARTBEAT_INTERVAL_S": "0.2", "DUPLEX_HEARTBEAT_TTL_S": "2.0"}
SHAPES = {"failover": signal.SIGKILL, "drain": signal.SIGTERM}
RATE = 24_000
CHUNK_MS = 80
#: how long to wait for the model to speak after the move before the run counts as silent
SPEAK_TIMEOUT_S = 180
RESTORED = re.compile(
    r"session (?P<sid>\S+) restored \((?P<frames>\d+) frames replayed in (?P<s>[\d.]+) s"
    r"(?:, (?P<pace>[\d.]+)x real time)?"
)


# ------------------------------------------------------------------ one move


@dataclass
class Move:
    tree: str
    shape: str
    talk_s: float
    history_frames: int = 0  # in Redis when the signal went
    signal_to_move_s: float = float("nan")
    speaks_s: float = float("nan")  # move (moved_at) -> first audio delta
    paused_to_audio_s: float = float("nan")  # drain: paused_at -> first audio delta
    seen_lag_s: float = float("nan")  # moved_at -> this program saw it (its polling)
    log_frames: int | None = None
    log_s: float | None = None
    log_pace: float | None = None
    progress: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    spoke_before: int = 0

    @property
    def pace(self) -> float | None:
        if self.log_pace is not None:
            return self.log_pace
        if self.log_frames and self.log_s:
            return self.log_frames * 0.08 / self.log_s
        return None


def speech_pcm() -> bytes:
    """What tests/e2e/native_moves.py streams: a 5-frame tone, then 0.5 s of quiet."""
    from harness.frame_models import tone
    from shared.protocol.duplex import float_to_pcm16

    audio = np.concatenate([tone(5), np.zeros(RATE // 2, np.float32)])
    return float_to_pcm16(audio)


async def stream(client: Any, pcm: bytes, stop: asyncio.Event) -> None:
    """A microphone: one 80 ms chunk every 80 ms on a fixed grid, until stopped."""
    step = RATE * 2 * CHUNK_MS // 1000
    started, n = time.monotonic(), 0
    while not stop.is_set():
        for start in range(0, len(pcm), step):
            if stop.is_set():
                return
            await client.append_audio(
                pcm[start : start + step], format="pcm16", sample_rate_hz=RATE
            )
            n += 1
            await asyncio.sleep(max(0.0, started + n * CHUNK_MS / 1000 - time.monotonic()))


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Fleet:
    """redis (shared), one API pod and two workers of one model, all from one tree."""

    def __init__(self, redis_url: str, model: str, model_dir: str, tree: Path) -> None:
        from harness.processes import start_api
        from harness.redis_server import free_port
        from shared.redis.connection import connect
        from shared.redis.keys import KeySchema

        self.redis_url, self.model, self.model_dir, self.tree = redis_url, model, model_dir, tree
        self.prefix = f"failover-{uuid.uuid4().hex[:6]}"
        self.keys = KeySchema(self.prefix)
        self.env = {"PYTHONPATH": str(tree), **FAST}
        self.ports = {name: free_port() for name in ("w-a", "w-b")}
        self.workers = {name: self._worker(name) for name in self.ports}
        self.api = start_api(redis_url, self.prefix, "failover-api", **self.env)
        self.handle = connect(redis_url)
        self.redis = self.handle.client

    def _worker(self, name: str) -> Any:
        from harness.processes import start_worker

        return start_worker(
            self.redis_url,
            self.prefix,
            name,
            self.model,
            DUPLEX_WORKER_HEALTH_PORT=str(self.ports[name]),
            DUPLEX_MODEL_DIR=self.model_dir,
            DUPLEX_PLUGIN_OPTIONS=OPTIONS[self.model],
            DUPLEX_MAX_SESSIONS="2",
            HF_HUB_OFFLINE="1",
            **self.env,
        )

    async def ready(self, timeout: float) -> None:
        from harness.processes import wait_worker_ready

        await asyncio.to_thread(self.api.wait_ready, timeout)
        for name, worker in self.workers.items():
            await asyncio.to_thread(wait_worker_ready, worker, self.ports[name], timeout)

    async def replace(self, name: str, timeout: float) -> None:
        """The gone worker started again under its id and health port, and ready."""
        from harness.processes import wait_worker_ready

        await asyncio.to_thread(self.workers[name].process.wait, 60)
        self.workers[name] = self._worker(name)
        await asyncio.to_thread(wait_worker_ready, self.workers[name], self.ports[name], timeout)

    async def meta(self, sid: str) -> dict[str, str]:
        raw = await self.redis.hgetall(self.keys.session(sid))
        return {text(k): text(v) for k, v in raw.items()}

    async def close(self) -> None:
        self.api.stop()
        for worker in self.workers.values():
            worker.stop()
        await self.handle.close()


async def wait_for(read: Any, ok: Any, timeout: float, every: float = 0.05) -> Any:
    """Poll `read()` until `ok(value)`; the value, or None after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = await read()
        if ok(value):
            return value
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(every)


async def one_move(
    fleet: Fleet, tree: str, shape: str, talk_s: float, load_s: float, *, replace: bool
) -> Move:
    """A session streamed into for `talk_s`, its worker signalled, until it speaks again;
    the signalled worker started again after (`replace`: another move follows)."""
    from harness.recording_client import RecordingClient, drain

    move = Move(tree, shape, talk_s)
    client = RecordingClient([fleet.api.base], heartbeat_s=None)
    # monotonic receipt times to wall-clock ones (the hash's times are wall-clock ms)
    wall = time.time() - time.monotonic()
    await client.connect({"model": fleet.model})
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(drain(client)),
        asyncio.create_task(stream(client, speech_pcm(), stop)),
    ]
    sid = client.session_id
    owner: str | None = None
    try:
        await asyncio.sleep(talk_s)
        meta = await fleet.meta(sid)
        owner = meta["worker"]
        # the record size the writer gave (its code's: the tiny Moshi's grew from 10 to 12)
        record = int(meta.get("model_record_bytes") or RECORD_BYTES[fleet.model])
        move.history_frames = int(await fleet.redis.strlen(fleet.keys.model_history(sid))) // record
        move.spoke_before = sum(
            1 for f in client.delivered if f.get("type") == "response.output_audio.delta"
        )
        signalled = time.time()
        fleet.workers[owner].process.send_signal(SHAPES[shape])
        gone = owner
        moved = await wait_for(
            lambda: fleet.meta(sid), lambda m: m.get("worker") not in (None, gone), 60, 0.01
        )
        seen = time.time()
        since = len(client.delivered)
        if moved is None:
            move.errors.append("the session never moved")
            return move
        moved_at = int(moved["moved_at"]) / 1000
        move.signal_to_move_s = moved_at - signalled
        move.seen_lag_s = seen - moved_at
        new_owner = moved["worker"]

        def first_audio() -> int | None:
            for index in range(since, len(client.delivered)):
                if client.delivered[index].get("type") == "response.output_audio.delta":
                    return index
            return None

        async def audio_index() -> int | None:
            return first_audio()

        index = await wait_for(audio_index, lambda i: i is not None, SPEAK_TIMEOUT_S)
        if index is None:
            move.errors.append(f"no audio within {SPEAK_TIMEOUT_S} s of the move")
        else:
            heard = client.received_at[index] + wall
            move.speaks_s = heard - moved_at
            after = await fleet.meta(sid)
            if "paused_at" in after:
                move.paused_to_audio_s = heard - int(after["paused_at"]) / 1000
        # the hash's restore report (code since bbb5b7d), once done
        report = await wait_for(
            lambda: fleet.redis.hget(fleet.keys.session(sid), "restore"),
            lambda data: data is not None and orjson.loads(data).get("done"),
            5,
        )
        move.progress = orjson.loads(report) if report else None
        # the new owner's log line of this restore
        worker = fleet.workers[new_owner]

        async def log_line() -> re.Match[str] | None:
            for found in RESTORED.finditer(worker.logs()):
                if found["sid"] == sid:
                    return found
            return None

        found = await wait_for(log_line, lambda m: m is not None, 10, 0.2)
        if found:
            move.log_frames, move.log_s = int(found["frames"]), float(found["s"])
            move.log_pace = float(found["pace"]) if found["pace"] else None
        move.errors += [
            (f.get("error") or {}).get("code", "?")
            for f in client.delivered
            if f.get("type") == "error"
        ]
        if client.ended:
            move.errors.append(f"session ended: {client.ended}")
        return move
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await client.close(end_session=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if owner is not None and replace:  # signalled: started again for the next move
            await fleet.replace(owner, load_s)


def tree_label(path: Path) -> str:
    """The commit a tree's workers run, and whether their code has uncommitted changes."""
    changed = dirty(["services", "shared", "plugins"], path)
    return commit(path) + (" + uncommitted changes" if changed else "")


def build_checkpoint(model: str, directory: Path) -> Path:
    if model == "moshi":
        from harness.tiny_moshi import make_tiny_moshi

        return make_tiny_moshi(directory)
    from harness.tiny_nemotron import build_tiny_checkpoint

    return build_tiny_checkpoint(directory)


# ------------------------------------------------------------------ the report


def spread(values: list[float], digits: int = 2) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f} s"
    return (
        f"{statistics.median(values):.{digits}f} s (median), "
        f"{min(values):.{digits}f}-{max(values):.{digits}f}"
    )


def table(moves: list[Move], trees: dict[str, str]) -> list[str]:
    rows = [
        "| code | shape | talk before the move | history in Redis at the signal "
        "| signal -> move | **move -> speaks again** | drain: paused -> speaks "
        "| restore (new worker's log) | hash `restore` | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for move in moves:
        log = (
            f"{move.log_frames} frames in {move.log_s:.2f} s"
            + (f", {move.pace:.1f}x" if move.pace else "")
            if move.log_s is not None
            else "-"
        )
        progress = (
            f"{move.progress['replayed']}/{move.progress['frames']} in "
            f"{move.progress['seconds']:.2f} s, {move.progress['pace']:.1f}x"
            if move.progress
            else "- (not written)"
        )
        rows.append(
            f"| {move.tree} ({trees[move.tree]}) | {move.shape} | {move.talk_s:g} s "
            f"| {move.history_frames} frames | {fmt(move.signal_to_move_s)} "
            f"| **{fmt(move.speaks_s)}** | {fmt(move.paused_to_audio_s)} | {log} | {progress} "
            f"| {', '.join(move.errors) or 'none'} |"
        )
    return rows


def fmt(value: float) -> str:
    return "-" if value != value else f"{value:.2f} s"


def summary(moves: list[Move], trees: dict[str, str], model: str) -> list[str]:
    target = TARGET_S[model]
    rows = [
        f"| code | shape | runs | move -> speaks again | restore pace (log) "
        f"| within {target:g} s |",
        "|---|---|---|---|---|---|",
    ]
    for tree in trees:
        for shape in SHAPES:
            mine = [m for m in moves if m.tree == tree and m.shape == shape]
            if not mine:
                continue
            speaks = [m.speaks_s for m in mine]
            paces = [m.pace for m in mine if m.pace]
            met = all(s == s and s <= target for s in speaks)
            rows.append(
                f"| {tree} ({trees[tree]}) | {shape} | {len(mine)} | **{spread(speaks)}** "
                f"| {', '.join(f'{p:.1f}x' for p in paces) or '-'} "
                f"| {'yes' if met else 'no'} |"
            )
    return rows


async def main(args: argparse.Namespace) -> int:
    from harness.redis_server import RedisServer

    model = args.model
    trees: dict[str, Path] = {}
    for spec in args.worker_tree or [f"this checkout={ROOT}"]:
        label, _, path = spec.partition("=")
        if not path:
            label, path = Path(spec).name, spec
        trees[label] = Path(path).resolve()
    shapes = args.shapes.split(",")
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: {shape} is not one of {', '.join(SHAPES)}")
    runs = args.runs or 1
    talk_s = args.talk_s or (3.0 if args.quick else 20.0)
    load_s = args.load_s
    labels = {label: tree_label(path) for label, path in trees.items()}

    load_start = os.getloadavg()
    started = time.monotonic()
    moves: list[Move] = []
    redis = RedisServer()
    try:
        with tempfile.TemporaryDirectory(prefix=f"tiny-{model}-") as directory:
            checkpoint = str(build_checkpoint(model, Path(directory)))
            for label, path in trees.items():
                fleet = Fleet(redis.url, model, checkpoint, path)
                try:
                    await fleet.ready(load_s)
                    plan = [(run, shape) for run in range(runs) for shape in shapes]
                    for n, (run, shape) in enumerate(plan):
                        last = n == len(plan) - 1
                        move = await one_move(fleet, label, shape, talk_s, load_s, replace=not last)
                        moves.append(move)
                        print(
                            f"{label}, {shape} {run + 1}/{runs}: signal -> move "
                            f"{fmt(move.signal_to_move_s)}, move -> speaks "
                            f"{fmt(move.speaks_s)}; restore {move.log_frames} frames in "
                            f"{move.log_s} s ({move.pace or 0:.1f}x); hash {move.progress}; "
                            f"errors {move.errors or 'none'}",
                            flush=True,
                        )
                finally:
                    await fleet.close()
    finally:
        redis.stop()
    elapsed = time.monotonic() - started
    load_end = os.getloadavg()

    venv = VENVS[model]
    command = f"HF_HUB_OFFLINE=1 {venv}/bin/python -m bench.native_failover --model {model}"
    if args.quick:
        command += " --quick"
    for flag, value in [
        ("--runs", args.runs),
        ("--talk-s", args.talk_s),
        ("--shapes", args.shapes if args.shapes != "failover,drain" else None),
    ]:
        if value is not None:
            command += f" {flag} {value}"
    for spec in args.worker_tree or []:
        command += f" --worker-tree '{spec}'"
    target = TARGET_S[model]
    body = [
        f"Measured {now_utc()} on {machine()}: `{command}` ({elapsed:.0f} s). Load average "
        f"(1 / 5 min) {load_start[0]:.2f} / {load_start[1]:.2f} at the start, "
        f"{load_end[0]:.2f} / {load_end[1]:.2f} at the end.",
        "",
        f"A real redis-server, one `duplex api` and two `duplex worker --plugin {model}` on "
        f"the tiny random checkpoint (`DUPLEX_PLUGIN_OPTIONS={OPTIONS[model]}`, "
        "`DUPLEX_MAX_SESSIONS=2`, heartbeat every 0.2 s, TTL 2 s), each code's processes "
        "started from its own tree (`PYTHONPATH`); one duplex-surface client streams a tone "
        f"and quiet in real time for {talk_s:g} s, then its worker gets SIGKILL (failover) "
        "or SIGTERM (drain). *Move -> speaks again*: from the hash's `moved_at` (the owner "
        "changed in Redis) to the first model audio delta the client receives after it "
        f"(target: within {target:g} s); *signal -> move*: a failover's is the heartbeat "
        "TTL and the sweep, a drain's the hand-over; *paused -> speaks*: a drain's whole "
        "silence, from the old worker's last served frame.",
        "",
        *summary(moves, labels, model),
        "",
        *table(moves, labels),
    ]
    text_body = "\n".join(body)
    print(text_body)
    write_section(
        "benchmarks.md",
        args.section if args.section != "native_failover" else f"native_failover_{model}",
        text_body,
        f"Speaking again after a move: tiny {model} (`bench/native_failover.py`)"
        + (f", {args.label}" if args.label else ""),
        docs=args.docs or DOCS,
    )
    silent = [m for m in moves if m.speaks_s != m.speaks_s]
    return 1 if silent else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Full runs: HF_HUB_OFFLINE=1 .venv-moshi/bin/python -m bench.native_failover "
        "--model moshi --runs 3; the same with .venv-nemotron and --model nemotron; before "
        "and after a change side by side: git worktree add /tmp/before COMMIT, then "
        "--worker-tree after=. --worker-tree before=/tmp/before.",
    )
    parser.add_argument("--model", choices=MODELS, required=True, help="the tiny checkpoint")
    parser.add_argument("--runs", type=int, default=None, help="moves of each shape (default 1)")
    parser.add_argument(
        "--talk-s",
        type=float,
        default=None,
        help="seconds of conversation before the move (default 20; --quick 3)",
    )
    parser.add_argument(
        "--shapes",
        default="failover,drain",
        help="failover (SIGKILL), drain (SIGTERM), comma-separated (default both)",
    )
    parser.add_argument(
        "--worker-tree",
        action="append",
        metavar="LABEL=PATH",
        help="run the API and workers from this checkout (repeatable; default this one)",
    )
    parser.add_argument(
        "--load-s",
        type=float,
        default=300,
        help="how long a worker may take to load and register (default 300)",
    )
    parser.add_argument("--quick", action="store_true", help="a short talk (the suite's run)")
    add_output_arguments(parser, "native_failover")
    return parser.parse_args(argv)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(asyncio.run(main(parse_args())))
