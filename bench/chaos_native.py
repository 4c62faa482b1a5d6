"""The native mode of bench/chaos.py: model-native sessions under killed, drained and
rolled workers, their model histories checked move by move.

Sessions of a frame-clocked model (services/worker/stages/tick_batched.py) stream 80 ms
of 24 kHz pcm16 at real-time pace over the duplex surface (a 400 ms tone, then 500 ms of
quiet, over and over), through two API pods, to three workers of the model:

- echo   `--plugin harness.frame_models:EchoFramePlugin` (this venv): each frame's record
         is the slot's step number (uint32), so a history is exactly 1..N, and its
         `restore_slot` refuses a history with a gap or a repeat (the session would close);
- moshi  the tiny random Moshi of harness/tiny_moshi.py (`--plugin moshi`, greedy, CPU),
         its workers run by .venv-moshi's `duplex`; 12-byte records (5 uint16 tokens and
         the barge-in's silence).

The chaos cycles kill, drain, roll (each at least once, then on until the deadline, a
pause of about `kill_every` seconds between actions): kill SIGKILLs the worker holding
the most sessions and restarts it under its id; drain SIGTERMs it (its sessions move at
once) and restarts it; roll drains and restarts the three in turn. After each stop the
next action waits until every session the stopped worker held is owned anew (its owner
generation in Redis went up) and its new worker logged the replay of its history.

What is checked for each session (`check_history`), besides bench.chaos's lost and
duplicated events and closed sessions:

- its model history (`KeySchema.model_history`) is whole records and contiguous: for the
  echo model exactly the steps 1..N; for Moshi whole 12-byte records, no more frames than
  the clock gave ticks since the session opened (one step per 80 ms at most, plus one per
  tenure for the grids' phases);
- append-only: a sampler reads every session's owner generation and history in one
  MULTI every `SAMPLE_S`; each snapshot must be a prefix of the last one (no record is
  ever rewritten with other bytes) and no longer than any later one;
- equal on both sides of each move: each move's restore is read from the new worker's log
  (`session <id> restored (<reason>, owner generation <G>` when the move is applied, then
  `<model>: session <id> restored (<N> frames replayed in <S> s` when its slot has
  replayed). The restore must have read at least every frame any earlier owner was seen to
  write (every snapshot under a generation below G holds at most N frames), and the
  history never falls below those N frames after it. Where the sampler caught the history
  under generation G before the new owner's first append (its length exactly N frames),
  the move is checked exactly: what the restore read is all its old owner wrote, byte for
  byte the prefix of the final history ("exact"); otherwise the new owner had appended
  already and the move is checked by the bound alone ("bounded"). For the echo model the
  restore also checks itself (1..N or refused).

Reported per move: frames replayed, seconds, and the pace against real time
(frames x 0.08 s / seconds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as redis_async

from bench.chaos_sessions import ENDINGS, ended_by
from bench.chaos_workers import STOP_TIMEOUT_S, WorkerChaos
from bench.common import ROOT, Stack
from harness.frame_models import RATE, tone
from harness.processes import Process
from harness.recording_client import Conversation, RecordingClient, check, drain
from shared.contracts.model_history import count_records
from shared.protocol.duplex import float_to_pcm16

FRAME_S = 0.08
#: how often the sampler reads every session's owner generation and model history
SAMPLE_S = 0.05
#: a session must have this many frames of history before the chaos begins (a move with
#: none would restore nothing: no replay, no log line to check)
WARM_FRAMES = 25
#: a stopped worker's sessions are owned anew and replayed within this
MOVE_TIMEOUT_S = 90.0
#: after the chaos, every session's model speaks again within this
SPEAK_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 30.0
WORKERS = 3

#: the line `MoveHandler.restore` logs when a move is applied on the new worker
MOVED_IN = re.compile(r"session (\S+) restored \(([^,()]+), owner generation (\d+)")
#: the line the tick stage logs when the slot has replayed the history (more may follow `s`)
REPLAYED = re.compile(r"(\S+): session (\S+) restored \((\d+) frames replayed in ([0-9.]+) s")

MOSHI_VENV = ROOT / ".venv-moshi"
MOSHI_OPTIONS = "device=cpu,temperature=0,temperature_text=0,threads=1"


@dataclasses.dataclass(frozen=True)
class NativeModel:
    name: str  # echo | moshi
    plugin: str  # the worker's --plugin
    model: str  # the session's model id
    record_bytes: int
    venv: Path | None = None  # whose `duplex` runs the workers (None: this interpreter's)
    load_s: float = 60.0  # a worker's start, its model loaded


ECHO = NativeModel("echo", "harness.frame_models:EchoFramePlugin", "frame_echo", 4)
#: the tiny Moshi's record: its text token, 2 model and 2 user audio codes and the
#: barge-in's silence, uint16 each (plugins/moshi/replay.py)
MOSHI = NativeModel("moshi", "moshi", "moshi", 12, MOSHI_VENV, 240.0)
MODELS = {"echo": ECHO, "moshi": MOSHI}


def moshi_available() -> bool:
    return (MOSHI_VENV / ".installed").exists()


# ------------------------------------------------------------------ what is checked


@dataclasses.dataclass
class Snapshot:
    at: float  # monotonic
    generation: int
    owner: str
    history: bytes


@dataclasses.dataclass
class Restore:
    """One move as the new worker logged it; frames/seconds None when the slot never
    finished its replay (the worker was stopped first, or the session moved on)."""

    worker: str
    session: str
    reason: str
    generation: int
    frames: int | None = None
    seconds: float | None = None

    @property
    def pace(self) -> float:
        """Real time replayed per second of replay (inf: too fast for the log's ms)."""
        assert self.frames is not None and self.seconds is not None
        return self.frames * FRAME_S / self.seconds if self.seconds > 0 else float("inf")


def parse_restores(log: str, worker: str) -> list[Restore]:
    """The moves one worker process applied, in its log's order, each with its replay."""
    found: list[Restore] = []
    pending: dict[str, Restore] = {}
    for line in log.splitlines():
        if match := REPLAYED.search(line):
            _, sid, frames, seconds = match.groups()
            restore = pending.pop(sid, None)
            if restore is None:  # a replay without its move: counted, checked as a problem
                restore = Restore(worker, sid, "?", 0)
                found.append(restore)
            restore.frames, restore.seconds = int(frames), float(seconds)
        elif match := MOVED_IN.search(line):
            sid, reason, generation = match.groups()
            restore = Restore(worker, sid, reason, int(generation))
            pending[sid] = restore
            found.append(restore)
    return found


#: the bound a sized record is checked against here (the history's own model knows its
#: exact bound; this only proves the history is whole records)
MAX_SIZED_RECORD = 1 << 30


def history_problems(model: str, data: bytes, record_bytes: int) -> list[str]:
    """Whole records, and for the echo model exactly the steps 1..N. `record_bytes` 0: a
    history of sized records (each after its 4-byte length), checked for whole records."""
    if record_bytes == 0:
        try:
            count_records(data, MAX_SIZED_RECORD, sized=True)
        except ValueError as exc:
            return [str(exc)]
        return []
    if len(data) % record_bytes:
        return [f"{len(data)} bytes is not whole {record_bytes}-byte records"]
    if model != "echo":
        return []
    steps = np.frombuffer(data, "<u4")
    expected = np.arange(1, len(steps) + 1, dtype=np.uint32)
    wrong = np.flatnonzero(steps != expected)
    if not len(wrong):
        return []
    at = int(wrong[0])
    seen = steps[max(0, at - 2) : at + 3].tolist()
    kind = "a repeat" if at and steps[at] <= steps[at - 1] else "a gap"
    return [f"{kind} at frame {at + 1}: steps {seen} around it"]


@dataclasses.dataclass
class HistoryFigures:
    frames: int = 0
    exact: int = 0  # moves whose old owner's whole history the sampler saw the restore read
    bounded: int = 0  # moves checked by the bound alone
    cut: int = 0  # moves whose replay never finished (the worker stopped first)
    coverage: float = 0.0  # frames x 80 ms / the session's wall time
    problems: list[str] = dataclasses.field(default_factory=list)


def check_history(
    model: str,
    record_bytes: int,
    snapshots: list[Snapshot],
    restores: list[Restore],
    opened_at: float,
) -> HistoryFigures:
    """One session's model history across its moves (module head). `snapshots` in the
    order they were read, the last one the final history; `restores` the session's moves
    from every worker's log."""
    figures = HistoryFigures()
    if not snapshots:
        figures.problems.append("no snapshot of its history")
        return figures
    final = snapshots[-1]
    figures.frames = len(final.history) // record_bytes
    figures.problems += history_problems(model, final.history, record_bytes)
    longest = 0
    for snap in snapshots:
        if not final.history.startswith(snap.history):
            figures.problems.append(
                f"rewritten: the history read at generation {snap.generation} "
                f"({len(snap.history)} bytes) is not a prefix of the final one"
            )
            break
        if len(snap.history) < longest:
            figures.problems.append(f"shrank from {longest} to {len(snap.history)} bytes")
            break
        longest = len(snap.history)
    moves = final.generation - 1
    by_generation: dict[int, Restore] = {}
    for restore in restores:
        if restore.generation in by_generation or restore.generation < 2:
            figures.problems.append(
                f"a restore at generation {restore.generation} ({restore.worker}): logged twice, "
                "or a replay without its move"
            )
        by_generation[restore.generation] = restore
    missing = sorted(set(range(2, final.generation + 1)) - set(by_generation))
    if missing:
        figures.problems.append(f"moves to generations {missing} logged by no worker")
    for generation, restore in sorted(by_generation.items()):
        if restore.frames is None:
            figures.cut += 1
            if generation == final.generation:
                figures.problems.append(f"its last owner never replayed it ({restore.worker})")
            continue
        read = restore.frames * record_bytes
        before = [s for s in snapshots if s.generation < generation]
        written = max((len(s.history) for s in before), default=0)
        if written > read:
            figures.problems.append(
                f"the restore at generation {generation} read {restore.frames} frames, its "
                f"earlier owners had written {written // record_bytes}"
            )
        after = [s for s in snapshots if s.generation >= generation]
        if any(len(s.history) < read for s in after):
            figures.problems.append(
                f"shorter than the {restore.frames} frames restored at generation {generation}"
            )
        first = next((s for s in after if s.generation == generation), None)
        if first is not None and len(first.history) == read:
            figures.exact += 1
        else:
            figures.bounded += 1
    elapsed = final.at - opened_at
    ticks = elapsed / FRAME_S + moves + 2
    if figures.frames > ticks:
        figures.problems.append(
            f"{figures.frames} frames in {elapsed:.1f} s: more than the clock's ticks"
        )
    figures.coverage = figures.frames * FRAME_S / elapsed if elapsed > 0 else 0.0
    return figures


# ------------------------------------------------------------------ the processes


class VenvProcess(Process):
    """A `duplex` process of another venv (harness.processes runs this interpreter's)."""

    def __init__(self, duplex: str, args: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.log = Path(tempfile.mkstemp(prefix=f"duplex-{name}-", suffix=".log")[1])
        environment = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
        environment.update(env)
        self.process = subprocess.Popen(
            [duplex, *args], env=environment, stdout=self.log.open("wb"), stderr=subprocess.STDOUT
        )


class NativeStack(Stack):
    """bench.common.Stack whose workers may run from another venv's `duplex`."""

    def __init__(self, *, duplex: str | None = None, **kwargs: Any) -> None:
        self.duplex = duplex
        super().__init__(**kwargs)

    def start_worker(self, name: str) -> Process:
        if self.duplex is None:
            return super().start_worker(name)
        env = {"DUPLEX_REDIS_URL": self.redis.url, "DUPLEX_KEY_PREFIX": self.prefix}
        args = ["worker", "--plugin", self.plugin, "--worker-id", name]
        return VenvProcess(self.duplex, args, {**env, **self.worker_env}, name)


def make_tiny_moshi(directory: Path) -> Path:
    """The tiny random checkpoint, built by .venv-moshi's python (torch lives there)."""
    code = (
        "import sys; from pathlib import Path; from harness.tiny_moshi import make_tiny_moshi; "
        "make_tiny_moshi(Path(sys.argv[1]))"
    )
    python = str(MOSHI_VENV / "bin" / "python")
    subprocess.run([python, "-c", code, str(directory)], cwd=ROOT, check=True, timeout=300)
    return directory


def native_stack(model: NativeModel, model_dir: Path | None) -> NativeStack:
    env = {"PYTHONPATH": str(ROOT)}
    duplex = None
    if model.name == "moshi":
        assert model_dir is not None
        env |= {
            "DUPLEX_MODEL_DIR": str(model_dir),
            "DUPLEX_PLUGIN_OPTIONS": MOSHI_OPTIONS,
            "DUPLEX_MAX_SESSIONS": "8",
            "HF_HUB_OFFLINE": "1",
        }
        duplex = str(MOSHI_VENV / "bin" / "duplex")
    return NativeStack(duplex=duplex, workers=WORKERS, apis=2, plugin=model.plugin, worker_env=env)


# ------------------------------------------------------------------ talking


async def talk(conversation: Any, stop: asyncio.Event) -> None:
    """A microphone: 80 ms appends at real-time pace (the pace is the microphone's, not an
    ordering of events), a tone of the session's own pitch then quiet, until `stop`."""
    client = conversation.client
    speech = np.concatenate(
        [tone(5, freq_hz=300.0 + 40 * (conversation.index % 8)), np.zeros(RATE // 2, np.float32)]
    )
    pcm = float_to_pcm16(speech)
    step = RATE * 2 * 80 // 1000
    chunks = [pcm[i : i + step] for i in range(0, len(pcm), step)]
    started, sent = time.monotonic(), 0
    try:
        while not stop.is_set():
            for chunk in chunks:
                if stop.is_set():
                    return
                async with asyncio.timeout(SEND_TIMEOUT_S):
                    await client.append_audio(chunk, format="pcm16", sample_rate_hz=RATE)
                sent += 1
                delay = started + sent * FRAME_S - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
    except ENDINGS as exc:
        conversation.ended_by = ended_by(exc, client)


def worker_lost_responses(client: Any) -> list[str]:
    """Responses that ended (failed, or incomplete as a native failover ends them) because
    their worker was lost."""
    lost = []
    for frame in client.delivered:
        if frame.get("type") != "response.done":
            continue
        response = frame.get("response") or {}
        details = json.dumps(response.get("status_details") or {})
        if response.get("status") in ("failed", "incomplete") and "worker_lost" in details:
            lost.append(response.get("id", ""))
    return lost


def spoke_since(client: Any, since: float) -> bool:
    return any(
        at > since and frame.get("type") == "response.output_audio.delta"
        for frame, at in zip(client.delivered, client.received_at, strict=True)
    )


# ------------------------------------------------------------------ the chaos


class NativeChaos(WorkerChaos):
    """Kill, drain and roll workers of a frame-clocked model under talking sessions, and
    sample every session's model history meanwhile (module head)."""

    def __init__(
        self, stack: Stack, conversations: list[Any], report: Any, model: NativeModel
    ) -> None:
        super().__init__(stack, conversations, report)
        self.model = model
        self.snapshots: dict[str, list[Snapshot]] = {}
        self.gaps: set[str] = set()  # sessions whose hash ever said model_gap
        self.record_bytes: set[int] = set()

    def processes(self) -> list[Process]:
        seen: dict[int, Process] = {}
        for process in [*self.retired, *self.stack.workers]:
            seen[id(process)] = process
        return list(seen.values())

    def restores(self) -> list[Restore]:
        return [r for p in self.processes() for r in parse_restores(p.logs(), p.name)]

    def replayed(self) -> Counter[str]:
        return Counter(r.session for r in self.restores() if r.frames is not None)

    # -------------------------------------------------- Redis

    async def sample(self, redis: redis_async.Redis) -> dict[str, Snapshot]:
        """Every session's owner generation, owner and model history, read at one instant
        (MULTI: one Redis runs nothing else between them)."""
        sids = [c.client.session_id for c in self.conversations]
        async with redis.pipeline(transaction=True) as pipe:
            for sid in sids:
                pipe.hmget(
                    self.keys.session(sid),
                    ["owner_generation", "worker", "model_gap", "model_record_bytes"],
                )
                pipe.get(self.keys.model_history(sid))
            values = await pipe.execute()
        at = time.monotonic()
        found = {}
        for index, sid in enumerate(sids):
            (generation, owner, gap, record_bytes), history = values[2 * index : 2 * index + 2]
            if gap is not None:
                self.gaps.add(sid)
            if record_bytes is not None:
                self.record_bytes.add(int(record_bytes))
            found[sid] = Snapshot(
                at, int(generation or 0), (owner or b"").decode(), bytes(history or b"")
            )
        return found

    def keep(self, found: dict[str, Snapshot], *, always: bool = False) -> None:
        for sid, snap in found.items():
            kept = self.snapshots.setdefault(sid, [])
            last = kept[-1] if kept else None
            if (
                always
                or last is None
                or (last.generation, len(last.history)) != (snap.generation, len(snap.history))
            ):
                kept.append(snap)

    async def sampler(self, stop: asyncio.Event) -> None:
        redis = self._redis()
        try:
            while not stop.is_set():
                self.keep(await self.sample(redis))
                await asyncio.sleep(SAMPLE_S)
            self.keep(await self.sample(redis), always=True)  # the final histories
        finally:
            await redis.aclose()

    async def _until(self, what: str, ok: Any, timeout: float) -> bool:
        """Poll `ok()` (awaitable) until true; False (a failure recorded) at the timeout."""
        deadline = time.monotonic() + timeout
        while not await ok():
            if time.monotonic() > deadline:
                self.report.failures.append(f"{what}: not within {timeout:.0f} s")
                return False
            await asyncio.sleep(0.05)
        return True

    async def wait_workers(self, redis: redis_async.Redis) -> None:
        async def registered() -> bool:
            return await redis.zcard(self.keys.workers()) >= len(self.stack.workers)

        if not await self._until("workers registered", registered, self.model.load_s):
            raise RuntimeError(f"workers not registered: {self.stack.workers[0].logs()[-2000:]}")

    async def wait_warm(self, redis: redis_async.Redis) -> None:
        """Every session's history holds WARM_FRAMES frames."""

        async def warm() -> bool:
            found = await self.sample(redis)
            need = WARM_FRAMES * self.model.record_bytes
            return all(len(s.history) >= need for s in found.values())

        await self._until("histories warm", warm, 60)

    async def _generations(self, redis: redis_async.Redis, sids: set[str]) -> dict[str, int]:
        return {
            sid: int(await redis.hget(self.keys.session(sid), "owner_generation") or 0)
            for sid in sids
        }

    async def _wait_moved(
        self, redis: redis_async.Redis, before: dict[str, int], replayed: Counter[str]
    ) -> None:
        """Each session owned anew (its generation went up) and replayed by its new worker."""

        async def moved() -> bool:
            now = await self._generations(redis, set(before))
            counts = self.replayed()
            return all(now[s] > before[s] and counts[s] > replayed[s] for s in before)

        await self._until(f"sessions {sorted(before)} moved and replayed", moved, MOVE_TIMEOUT_S)

    # -------------------------------------------------- actions

    async def _stop_one(self, redis: redis_async.Redis, index: int, kill: bool) -> None:
        old = self.stack.workers[index]
        members = await redis.smembers(self.keys.worker_sessions(old.name))
        held = {m.decode() for m in members}
        before_gen = await self._generations(redis, held)
        replayed = self.replayed()
        started = await self._started_at(redis, old.name)
        if kill:
            self.report.kills += 1
            self.kills.append((time.monotonic(), held))
            old.kill()
            self.killed.append(old)
        else:
            code = await asyncio.to_thread(old.stop, STOP_TIMEOUT_S)
            if code != 0:
                self.report.failures.append(f"{old.name} exited {code} on SIGTERM")
        self.retired.append(old)
        self.stack.workers[index] = self.stack.start_worker(old.name)
        await self._wait_registered(redis, old.name, started)
        await self._wait_moved(redis, before_gen, replayed)
        await self._read_moves(redis)

    async def _read_moves(self, redis: redis_async.Redis) -> None:
        """The pauses of drain moves visible now in the session hashes (each move once; a
        failover's move has no pause of its own: `paused_at` is an earlier drain's)."""
        for conversation in self.conversations:
            sid = conversation.client.session_id
            meta = await redis.hgetall(self.keys.session(sid))
            moves = meta.get(b"moves")
            if moves is None or (sid, moves.decode()) in self._seen_moves:
                continue
            if meta.get(b"moved_why") != b"drain":
                self._seen_moves.add((sid, moves.decode()))
                continue
            paused, restored = meta.get(b"paused_at"), meta.get(b"restored_at")
            # restored_at is the previous move's until the new owner marks this one
            if paused and restored and int(restored) >= int(paused):
                self._seen_moves.add((sid, moves.decode()))
                self.report.pause_ms.append(float(int(restored) - int(paused)))

    async def _busiest(self, redis: redis_async.Redis) -> int:
        counts = [await redis.scard(self.keys.worker_sessions(w.name)) for w in self.stack.workers]
        return max(range(len(counts)), key=counts.__getitem__)

    async def act(self, redis: redis_async.Redis, action: str) -> None:
        if action == "kill":
            await self._stop_one(redis, await self._busiest(redis), kill=True)
        elif action == "drain":
            await self._stop_one(redis, await self._busiest(redis), kill=False)
            self.report.drains += 1
        else:
            for index in range(len(self.stack.workers)):
                await self._stop_one(redis, index, kill=False)
            self.report.rolls += 1

    async def run(self, deadline: float, every: float) -> None:
        """kill, drain, roll, ...: each once whatever the time, then on until the deadline."""
        redis = self._redis()
        try:
            done: set[str] = set()
            actions = ["kill", "drain", "roll"]
            turn = 0
            while len(done) < len(actions) or time.monotonic() + every < deadline:
                await asyncio.sleep(every * random.uniform(0.7, 1.3))
                action = actions[turn % len(actions)]
                turn += 1
                failures = len(self.report.failures)
                try:
                    await self.act(redis, action)
                except RuntimeError as exc:  # a worker that did not register again
                    self.report.failures.append(str(exc)[:300])
                done.add(action)
                if len(self.report.failures) > failures:
                    return  # a worker that did not come back, or sessions that did not move
        finally:
            await redis.aclose()


# ------------------------------------------------------------------ the run


async def run_native(
    report: Any, sessions: int, seconds: float, kill_every: float, model: NativeModel
) -> None:
    """The native mode of bench.chaos.run_chaos: fills `report` (a ChaosReport)."""

    report.model = model.name
    model_dir = None
    with tempfile.TemporaryDirectory(prefix="chaos-native-") as scratch:
        if model.name == "moshi":
            model_dir = make_tiny_moshi(Path(scratch) / "tiny-moshi")
        with native_stack(model, model_dir) as stack:
            conversations = []
            chaos = NativeChaos(stack, conversations, report, model)
            redis = chaos._redis()
            tasks: list[asyncio.Task[None]] = []
            stop_talking, stop_sampling = asyncio.Event(), asyncio.Event()
            opened_at: dict[str, float] = {}
            sampler = None
            try:
                await chaos.wait_workers(redis)
                bases = [api.base for api in stack.apis]
                for index in range(sessions):
                    urls = bases[index % 2 :] + bases[: index % 2]
                    client = RecordingClient(urls, heartbeat_s=1.0, ack_every=16)
                    opened = time.monotonic()
                    await client.connect({"model": model.model})
                    opened_at[client.session_id] = opened
                    conversation = Conversation(client, index, audio_checked=False)
                    conversations.append(conversation)
                    tasks.append(asyncio.create_task(drain(client)))
                    tasks.append(asyncio.create_task(talk(conversation, stop_talking)))
                sampler = asyncio.create_task(chaos.sampler(stop_sampling))
                await chaos.wait_warm(redis)
                await chaos.run(time.monotonic() + seconds, kill_every)
                after = time.monotonic()

                async def all_spoke() -> bool:
                    return all(
                        spoke_since(c.client, after) or c.ended_by or c.client.ended
                        for c in conversations
                    )

                await chaos._until("every session spoke after the chaos", all_spoke, 60)
                stop_talking.set()
                await chaos.collect_moves()
            finally:
                stop_talking.set()
                stop_sampling.set()
                for conversation in conversations:  # ended before the run did (not by close)
                    conversation.ended_by = conversation.ended_by or conversation.client.ended
                if sampler is not None:
                    await asyncio.gather(sampler, return_exceptions=True)
                for conversation in conversations:
                    await conversation.client.close(end_session=conversation.ended_by is None)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await redis.aclose()
            report.tracebacks = sum(
                p.logs().count("Traceback")
                for p in [*stack.apis, *chaos.processes()]
                if p not in chaos.killed
            )
            restores = chaos.restores()
    account(report, chaos, conversations, restores, opened_at, check)


def account(
    report: Any,
    chaos: NativeChaos,
    conversations: list[Any],
    restores: list[Restore],
    opened_at: dict[str, float],
    check: Any,
) -> None:
    model = chaos.model
    if chaos.record_bytes - {model.record_bytes}:
        report.failures.append(
            f"records of {sorted(chaos.record_bytes)} bytes, not {model.record_bytes}"
        )
    victims = set().union(*(held for _, held in chaos.kills)) if chaos.kills else set()
    for conversation in conversations:
        client = conversation.client
        sid = client.session_id
        figures = check(conversation)
        report.events += figures["events"]
        report.lost += figures["lost"]
        report.duplicated += figures["duplicated"]
        if figures["lost"]:
            report.failures.append(f"session {conversation.index}: seqs {figures['missing']} lost")
        report.resumes += client.resumes
        report.input_lost += client.input_lost
        if conversation.ended_by is not None:
            report.closed += 1
            report.failures.append(f"session {conversation.index}: {conversation.ended_by}")
        cut = len(worker_lost_responses(client))
        if sid in victims:
            report.failed_victims += cut
        elif cut:
            report.failed_others += cut
            report.failures.append(f"session {conversation.index}: {cut} responses lost a worker")
        mine = [r for r in restores if r.session == sid]
        history = check_history(
            model.name, model.record_bytes, chaos.snapshots.get(sid, []), mine, opened_at[sid]
        )
        if sid in chaos.gaps:
            history.problems.append("its hash says model_gap")
        report.exact_moves += history.exact
        report.bounded_moves += history.bounded
        report.restores_cut += history.cut
        report.history_frames.append(history.frames)
        report.coverage.append(history.coverage)
        if history.problems:
            report.history_problems += len(history.problems)
            report.failures.append(f"session {conversation.index} history: {history.problems[0]}")
        else:
            report.histories_contiguous += 1
        for restore in mine:
            if restore.frames is not None and restore.seconds is not None:
                report.restores.append((restore.frames, restore.seconds))


if __name__ == "__main__":  # pragma: no cover - run bench.chaos --mode native
    sys.exit("run: python -m bench.chaos --mode native")
