"""A moved session's restore through the real tick stage: its time and pace against the
history's length, against what the machine allows, with live sessions busy beside it.

A model-native session that moves to another worker gets its model's memory back by
replaying the history of its frames' records between the ticks' steps of the sessions
already there (`restore_slot`, `replay_work(slot, frames)`: services/worker/stages/
tick_batched.py sizes each call by the replay's measured cost to the tick's spare time,
one frame a tick at least). Measured here, on one tiny random checkpoint per run (the
model's own venv: `--model moshi` with `.venv-moshi`, `--model nemotron` with
`.venv-nemotron`), CPU, 1 torch thread:

- for each history length (default 250, 1000, 3000, 7500 frames: 20 s, 80 s, 4 min and
  10 min of conversation at 80 ms a frame), first **back to back**: the history replayed
  by `restore_slot` + `replay_work(slot, replay_chunk_frames)` calls one after the other,
  no stage, nothing else running (the stage idle, its sessions closed): the machine's
  ceiling for this model;
- then, on a `TickBatchedStagePort` on the real clock with `--busy` sessions fed speech
  in real time (opened fresh for each length, warmed, then a window of their step time
  alone), a **drain-shaped** restore (the complete history, as a drained worker hands it
  over) and a **failover-shaped** one (the history as last written: `--lost-s` shorter,
  what a worker's once-a-second append can leave unwritten when it dies); in both, the
  restored session's live input arrives meanwhile, as its client keeps streaming. At the
  stage the two differ in nothing but the history's length: what differs between a drain
  and a failover before the restore starts (the dead worker's detection, the hand-over)
  is `bench/native_failover.py`'s.

Each restore: its seconds (from `submit_initial`, which opens the slot and decodes the
history, to the replay's end, when the slot steps again), its pace (seconds of
conversation per second), the stage's `replay_work` calls and cost per frame (its log
line), the busy sessions' step time p50/p99 and deadline misses during it; the
back-to-back ceiling, the ceiling the live sessions leave free (back-to-back pace x
(1 - their step time / the frame)) and the pace through the stage over that ceiling.

The history: `--base-frames` frames stepped live in a batch of one on speech, repeated to
each length (a replay's cost depends on its length and its position, not on what was
said). Writes the section `restore_pace_<model>` of docs/benchmarks.md and the plot
docs/img/restore_pace_<model>.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    DOCS,
    add_output_arguments,
    commit,
    dirty,
    machine,
    now_utc,
    percentile,
    write_section,
)
from bench.native_restore import feed

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = "250,1000,3000,7500"
QUICK_SIZES = "30,90"
#: ticks the stage runs after its sessions open, before anything is measured
WARMUP_TICKS = 12
#: frames restored untimed first, back to back and through the stage (allocation, kernels)
WARM_RESTORE_FRAMES = 8
#: ticks the restored session steps after its restore before it is closed
AFTER_TICKS = 3
#: what the stage's log line says of a restore
RESTORED = re.compile(
    r"session (?P<sid>\S+) restored \((?P<frames>\d+) frames replayed in (?P<s>[\d.]+) s, "
    r"(?P<pace>[\d.]+)x real time, (?P<calls>\d+) calls, (?P<ms>[\d.]+) ms a frame\)"
)
MODELS = ("moshi", "nemotron")
VENVS = {"moshi": ".venv-moshi", "nemotron": ".venv-nemotron"}


# ------------------------------------------------------------------ the models


class TinyModel:
    """A tiny random checkpoint in a temporary folder, and frame models made from it by the
    model's plugin (as a worker makes them: its default replay_chunk_frames)."""

    def __init__(self, name: str, threads: int) -> None:
        self.name = name
        self._directory = tempfile.TemporaryDirectory(prefix=f"tiny-{name}-")
        path = Path(self._directory.name)
        if name == "moshi":
            from harness.tiny_moshi import make_tiny_moshi
            from plugins.moshi import MoshiPlugin

            make_tiny_moshi(path)
            options = {"temperature": "0", "temperature_text": "0"}
            self.plugin: Any = MoshiPlugin.from_options(
                {"model_dir": str(path), "device": "cpu", "threads": str(threads), **options}
            )
        else:
            from harness.tiny_nemotron import build_tiny_checkpoint
            from plugins.nemotron.plugin import NemotronPlugin

            build_tiny_checkpoint(path)
            self.plugin = NemotronPlugin.from_options(
                {"model_dir": str(path), "device": "cpu", "threads": str(threads)}
            )

    def model(self, slots: int) -> Any:
        return self.plugin.frame_model(slots)

    def close(self) -> None:
        self._directory.cleanup()


def speech(rate: int) -> np.ndarray:
    from bench.tick_batched import speech_at

    return speech_at(rate)


def base_history(tiny: TinyModel, frames: int) -> tuple[bytes, float]:
    """One slot stepped `frames` times on speech in a batch of one: its records, and its
    median step time."""
    model = tiny.model(1)
    audio = speech(model.input_sample_rate_hz)
    frame = model.frame_samples
    active = np.ones(1, dtype=bool)
    model.open_slot(0, {})
    records, step_s = bytearray(), []
    for n in range(frames):
        chunk = np.take(audio, range(n * frame, (n + 1) * frame), mode="wrap")[None]
        started = time.perf_counter()
        output = model.step(chunk.astype(np.float32), active)[0]
        step_s.append(time.perf_counter() - started)
        records += output.record
    model.close()
    return bytes(records), statistics.median(step_s)


def tiled(base: bytes, record: int, frames: int) -> bytes:
    """`frames` records: the base history repeated."""
    reps = -(-frames // (len(base) // record))
    return (base * reps)[: frames * record]


def back_to_back(model: Any, slot: int, history: bytes) -> tuple[float, int]:
    """`restore_slot` + `replay_work(slot, replay_chunk_frames)` until done, nothing between:
    its seconds and calls (the slot closed after)."""
    started = time.perf_counter()
    model.restore_slot(slot, {}, history)
    calls = 0
    while model.replay_pending(slot):
        model.replay_work(slot, model.replay_chunk_frames)
        calls += 1
    spent = time.perf_counter() - started
    model.close_slot(slot)
    return spent, calls


# ------------------------------------------------------------------ the stage


class RestoreLog(logging.Handler):
    """The stage's `restored (...)` log lines, parsed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: dict[str, dict[str, float]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        found = RESTORED.search(record.getMessage())
        if found:
            self.lines[found["sid"]] = {
                k: float(found[k]) for k in ("frames", "s", "pace", "calls", "ms")
            }


@dataclass
class StageRestore:
    shape: str
    frames: int
    seconds: float
    open_s: float
    calls: int
    ms_a_frame: float
    step_s: list[float] = field(default_factory=list)
    ticks: int = 0
    misses: int = 0
    frame_s: float = 0.08

    @property
    def pace(self) -> float:
        return self.frames * self.frame_s / self.seconds

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.step_s) * 1000 if self.step_s else float("nan")

    @property
    def p99_ms(self) -> float:
        return percentile(sorted(self.step_s), 0.99) * 1000 if self.step_s else float("nan")


@dataclass
class SizeFigures:
    frames: int
    b2b_s: float
    b2b_calls: int
    busy_step_s: list[float]
    busy_misses: int
    restores: list[StageRestore]
    frame_s: float = 0.08

    @property
    def b2b_pace(self) -> float:
        return self.frames * self.frame_s / self.b2b_s

    @property
    def busy_p50_s(self) -> float:
        return statistics.median(self.busy_step_s)

    @property
    def free_pace(self) -> float:
        return self.b2b_pace * max(0.0, 1 - self.busy_p50_s / self.frame_s)


class Stage:
    """A `TickBatchedStagePort` on the real clock over `model`, its busy sessions fed
    speech in real time, and restored sessions opened on it."""

    def __init__(self, model: Any, name: str, busy: int, log: RestoreLog) -> None:
        from services.worker.stages.tick_batched import TickBatchedStagePort

        self.model = model
        self.port = TickBatchedStagePort(model, model_name=name)
        self.busy = busy
        self.log = log
        self.audio = speech(model.input_sample_rate_hz)
        self.feeders: dict[str, asyncio.Task[None]] = {}
        self.count = 0

    async def open(self, history: bytes | None) -> str:
        from shared.contracts import DuplexFence, ModelHistory, StagePlan

        self.count += 1
        fence = DuplexFence(f"restore-pace-{self.count}", 1, 1)
        port, sid = self.port, fence.session_id
        port.bind(sid, lambda output: None)
        request_id = await port.ensure(fence, "model")
        if history is not None:
            kept = ModelHistory(self.model.state_record_bytes, history)
            port.keep_history(sid, kept, responding=False)
        frame = self.model.frame_samples
        offset = (self.count * len(self.audio)) // (self.busy + 1) // frame * frame
        self.feeders[sid] = asyncio.create_task(feed(port, sid, self.audio, offset))
        await port.submit_initial(StagePlan(request_id, fence, "model", {}))
        return sid

    async def close(self, sid: str) -> None:
        task = self.feeders.pop(sid)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self.port.cleanup(sid)

    async def ticks(self, count: int) -> list[float]:
        """The next `count` ticks' step times."""
        steps: list[float] = []
        end = self.port.ticks + count
        while self.port.ticks < end:
            seen = self.port.ticks
            await self.port.wait_ticks(seen + 1)
            if self.port.ticks == seen + 1:  # the tick waited for: its step is the last
                steps.append(self.port.last_tick_s)
        return steps

    async def restore(self, shape: str, history: bytes) -> StageRestore:
        """One session restored from `history` while the busy ones step; until its replay
        ends, then a few of its own steps, then closed."""
        port = self.port
        counters = port.counters
        misses, ticks, restores = counters.deadline_misses, port.ticks, counters.restores
        started = time.perf_counter()
        sid = await self.open(history)
        open_s = time.perf_counter() - started
        steps: list[float] = []
        while counters.restores == restores:
            seen = port.ticks
            await port.wait_ticks(seen + 1)
            if port.ticks == seen + 1:
                steps.append(port.last_tick_s)
        (progress,) = [p for p in port.restore_progress() if p.session_id == sid]
        figures = StageRestore(
            shape,
            progress.frames,
            open_s + progress.seconds,
            open_s,
            int(self.log.lines.get(sid, {}).get("calls", 0)),
            self.log.lines.get(sid, {}).get("ms", float("nan")),
            steps,
            port.ticks - ticks,
            counters.deadline_misses - misses,
            self.model.frame_ms / 1000,
        )
        await self.ticks(AFTER_TICKS)
        await self.close(sid)
        return figures

    async def shutdown(self) -> None:
        for sid in list(self.feeders):
            await self.close(sid)
        await self.port.shutdown()


async def measure(
    stage: Stage, history: bytes, sizes: list[int], lost: int, window_ticks: int
) -> list[SizeFigures]:
    model = stage.model
    record = model.state_record_bytes
    frame_s = model.frame_ms / 1000
    slot = model.slots - 1  # the busy sessions are closed meanwhile: any slot is free
    back_to_back(model, slot, tiled(history, record, WARM_RESTORE_FRAMES))
    results = []
    for frames in sizes:
        full = tiled(history, record, frames)
        b2b_s, calls = back_to_back(model, slot, full)
        print(
            f"{frames} frames back to back: {b2b_s:.3f} s in {calls} calls, "
            f"{frames * frame_s / b2b_s:.1f}x real time",
            flush=True,
        )
        busy = [await stage.open(None) for _ in range(stage.busy)]
        await stage.ticks(WARMUP_TICKS)
        misses = stage.port.counters.deadline_misses
        busy_steps = await stage.ticks(window_ticks)
        busy_misses = stage.port.counters.deadline_misses - misses
        if frames == sizes[0]:
            await stage.restore("warm", tiled(history, record, WARM_RESTORE_FRAMES))
        restores = []
        for shape, length in (("drain", frames), ("failover", max(1, frames - lost))):
            done = await stage.restore(shape, full[: length * record])
            restores.append(done)
            print(
                f"{frames} frames, {shape}: {done.frames} frames in {done.seconds:.3f} s, "
                f"{done.pace:.1f}x real time, {done.calls} calls, {done.ms_a_frame:.2f} ms a "
                f"frame; busy steps p50 {done.p50_ms:.1f} / p99 {done.p99_ms:.1f} ms, "
                f"{done.misses} deadline misses in {done.ticks} ticks",
                flush=True,
            )
        for sid in busy:
            await stage.close(sid)
        results.append(
            SizeFigures(frames, b2b_s, calls, busy_steps, busy_misses, restores, frame_s)
        )
    return results


# ------------------------------------------------------------------ the report


def conversation(frames: int, frame_s: float) -> str:
    seconds = frames * frame_s
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def steps(restore: StageRestore) -> str:
    """The live steps' p50 / p99 during a restore; none when it ended before a tick."""
    if not restore.step_s:
        return "- (ended before the next tick)"
    return f"{restore.p50_ms:.1f} / {restore.p99_ms:.1f} ms"


def table(results: list[SizeFigures]) -> list[str]:
    rows = [
        "| history | shape | frames replayed | restore | pace | `replay_work` calls, ms a frame "
        "| back to back (same history) | free ceiling | through stage / free ceiling "
        "| live steps p50 / p99 during | deadline misses during |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in results:
        for r in size.restores:
            rows.append(
                f"| {size.frames} ({conversation(size.frames, size.frame_s)}) | {r.shape} "
                f"| {r.frames} | {r.seconds:.2f} s | **{r.pace:.1f}x** "
                f"| {r.calls}, {r.ms_a_frame:.2f} ms "
                f"| {size.b2b_s:.2f} s, {size.b2b_pace:.1f}x "
                f"| {size.free_pace:.1f}x | **{r.pace / size.free_pace:.0%}** "
                f"| {steps(r)} | {r.misses} of {r.ticks} |"
            )
    return rows


def plot(results: list[SizeFigures], model: str, path: Path) -> str:
    """Restore time against the history's length; the plot's file name, or why none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"no plot: matplotlib is not importable here ({error})"
    frame_s = results[0].frame_s
    minutes = [s.frames * frame_s / 60 for s in results]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for shape, marker in (("drain", "o"), ("failover", "s")):
        ax.plot(
            minutes,
            [next(r for r in s.restores if r.shape == shape).seconds for s in results],
            marker=marker,
            label=f"through the stage, {shape}-shaped",
        )
    ax.plot(minutes, [s.b2b_s for s in results], "k--", label="back to back (ceiling)")
    ax.plot(
        minutes,
        [s.frames * frame_s / s.free_pace for s in results],
        "k:",
        label="at the free ceiling (back to back / share free)",
    )
    ax.plot(minutes, [m * 60 for m in minutes], color="grey", lw=0.8, label="real time (1x)")
    ax.axhline(frame_s, color="grey", ls="-.", lw=0.8, label="one frame (the wait for a tick)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("history (minutes of conversation)")
    ax.set_ylabel("restore time (s)")
    ax.set_title(f"Restore time, tiny {model} (CPU, 1 thread), live sessions busy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def gpu_estimate(model: str, cpu_ms: float) -> str:
    """The real-size expectation; `cpu_ms`: this run's back-to-back cost a frame."""
    if model == "moshi":
        return (
            "**On a GPU, at real size (an estimate from arithmetic, not measured):** "
            "Moshi-7B replays a call's frames (up to `replay_chunk_frames`, 64) in one "
            "forward of its 7.69 B-parameter transformer over those positions (no "
            "depformer, no Mimi). In bf16 that reads its 15.4 GB of weights once, about "
            "4.6 ms at an H100's 3.35 TB/s, plus about 1 TFLOP for 64 positions (2 x "
            "7.7e9 x 64), about 1-2 ms: roughly 0.1 ms a frame, so 10 minutes of "
            "conversation (7,500 frames) in under a second back to back; through the stage "
            "the replay gets what the live steps leave of each 80 ms (half of it, on a "
            "worker stepped to half its frame: 1-2 s for 10 minutes). How near the stage comes "
            "to such a ceiling is the ratio column above; the GPU's own figures are "
            "`bench/gpu_native.py`'s (its H200 run is still pending)."
        )
    return (
        "**On a GPU, at real size (an estimate from arithmetic, not measured):** Nemotron "
        "VoiceChat replays a call's frames (up to `replay_chunk_frames`, 128) in one "
        "forward of each part (the FastConformer over their audio, Nemotron-H over their "
        "positions, the EAR-TTS backbone fed the records' codes; no sampling, no codec). In "
        "bf16 a call reads the model's weights once, about 11 B parameters, 22 GB: about "
        "6.6 ms at an H100's 3.35 TB/s (4.6 ms at an H200's 4.8 TB/s), plus about 2.8 "
        "TFLOP for 128 frames (2 x 11e9 x 128), 3-6 ms, and one forward's kernel launches: "
        "roughly 12-18 ms a call, about 0.1 ms a frame, so 10 minutes of conversation "
        "(7,500 frames) in 1-2 s back to back; through the stage the replay gets what the "
        "live steps leave of each 80 ms (half of it, on a worker stepped to half its frame: "
        "2-4 s for 10 minutes). "
        f"This run's tiny model: {cpu_ms:.2f} ms a frame back to back on this CPU. The "
        "GPU's own figures are `bench/gpu_native.py`'s (its run is still pending)."
    )


TARGETS = {"moshi": 20.0, "nemotron": 4.0}


def verdict(results: list[SizeFigures], model: str) -> list[str]:
    target = TARGETS[model]
    paces = [r.pace for s in results for r in s.restores]
    ratios = [r.pace / s.free_pace for s in results for r in s.restores]
    misses = sum(r.misses for s in results for r in s.restores)
    ticks = sum(r.ticks for s in results for r in s.restores)
    slowest = min(paces)
    return [
        "| target | measured | met |",
        "|---|---|---|",
        f"| pace through the stage at least {target:g}x real time (tiny {model}, this CPU) "
        f"| {slowest:.1f}x at the slowest, {max(paces):.1f}x at the fastest "
        f"| {'yes' if slowest >= target else 'no'} |",
        f"| through the stage at least 80% of the free ceiling | {min(ratios):.0%} to "
        f"{max(ratios):.0%} | {'yes' if min(ratios) >= 0.8 else 'no'} |",
        f"| the live sessions' deadline misses during restores: 0 | {misses} in {ticks} ticks "
        f"| {'yes' if misses == 0 else 'no'} |",
    ]


async def main(args: argparse.Namespace) -> None:
    import torch

    model_name = args.model
    sizes = [int(n) for n in (args.sizes or (QUICK_SIZES if args.quick else SIZES)).split(",")]
    busy = args.busy
    window_ticks = args.window_ticks or (6 if args.quick else 25)
    base_frames = min(args.base_frames or (30 if args.quick else 250), max(sizes))
    section = args.section if args.section != "restore_pace" else f"restore_pace_{model_name}"
    docs = args.docs

    log = RestoreLog()
    logging.getLogger("services.worker.stages.tick_batched").addHandler(log)
    logging.getLogger("services.worker.stages.tick_batched").setLevel(logging.INFO)

    load_start = os.getloadavg()
    started = time.monotonic()
    # the code measured is the code imported now: its commit and changes before they can move
    measured = commit()
    changed = dirty(["plugins", "services/worker/stages", "shared/contracts", "bench"])
    tiny = TinyModel(model_name, args.threads)
    try:
        history, base_step_s = base_history(tiny, base_frames)
        model = tiny.model(busy + 1)
        frame_ms, record_bytes = model.frame_ms, model.state_record_bytes
        chunk = model.replay_chunk_frames
        lost = max(1, round(args.lost_s * 1000 / frame_ms))
        stage = Stage(model, model_name, busy, log)
        try:
            results = await measure(stage, history, sizes, lost, window_ticks)
        finally:
            await stage.shutdown()
    finally:
        tiny.close()
    elapsed = time.monotonic() - started
    load_end = os.getloadavg()

    venv = VENVS[model_name]
    command = f"HF_HUB_OFFLINE=1 {venv}/bin/python -m bench.restore_pace --model {model_name}"
    if args.quick:
        command += " --quick"
    for flag, value in [
        ("--sizes", args.sizes),
        ("--busy", busy if busy != 2 else None),
        ("--base-frames", args.base_frames),
        ("--window-ticks", args.window_ticks),
        ("--lost-s", args.lost_s if args.lost_s != 1.0 else None),
        ("--threads", args.threads if args.threads != 1 else None),
    ]:
        if value is not None:
            command += f" {flag} {value}"
    image = (
        plot(results, model_name, (docs or DOCS) / "img" / f"{section}.png")
        if not args.no_plot
        else "no plot (--no-plot)"
    )
    first = results[0]
    busy_p50 = statistics.median([s.busy_p50_s for s in results]) * 1000
    reach = (0.9 * frame_ms - busy_p50) / (frame_ms - busy_p50)
    body = [
        f"Measured {now_utc()} on {machine()}, commit {measured}"
        + (f" (uncommitted changes in: {changed})" if changed else "")
        + f": `{command}` ({elapsed:.0f} s). Load average (1 / 5 min) {load_start[0]:.2f} / "
        f"{load_start[1]:.2f} at the start, {load_end[0]:.2f} / {load_end[1]:.2f} at the end "
        "(other work on this 2-core machine shares its cores with the steps and the replay).",
        "",
        f"The tiny random {model_name} (`harness/tiny_{model_name}.py`, plugins/{model_name}, "
        f"CPU, torch {torch.__version__}, {args.threads} thread), {frame_ms:g} ms frames, "
        f"{record_bytes:,}-byte records, `replay_chunk_frames` {chunk} (the plugin's "
        f"default); {busy} live sessions fed speech in real time beside each restore "
        f"(their step alone: {busy_p50:.1f} ms median, {first.busy_misses} deadline misses "
        f"in the {window_ticks} ticks before the first restore). The history: "
        f"{base_frames} frames stepped live ({base_step_s * 1000:.1f} ms a step, batch of "
        f"one), repeated to each length. Failover-shaped: {lost} frames "
        f"({lost * frame_ms / 1000:g} s) shorter than drain-shaped; at the stage that is the "
        "only difference (both hear their live input meanwhile).",
        "",
        *verdict(results, model_name),
        "",
        *table(results),
        "",
        f"![restore time against history, tiny {model_name}](img/{image})"
        if image.endswith(".png")
        else image,
        "",
        "*Restore*: from `submit_initial` (the slot opened, the history decoded) to the "
        "replay's end, when the slot steps again. *Back to back*: the same history replayed "
        "by `restore_slot` + `replay_work(slot, replay_chunk_frames)` one call after the "
        "other, no stage, its sessions closed, just before. *Free ceiling*: the back-to-back "
        "pace times the share of a frame the live steps leave (1 - their median step alone / "
        f"{frame_ms:g} ms); the stage also keeps a tenth of the frame of each tick's spare "
        "time as margin, so (frame - step - margin) / (frame - step) of it is the most it "
        f"can reach ({reach:.0%} with the live steps' {busy_p50:.1f} ms). A restore begins "
        "at once (in the tick's wait for its next frame, since a2f2178) and goes on in the "
        "ticks' spare time; one shorter than that wait beats the ceiling, which counts the "
        "live steps' share of every frame. *Live steps during*: the busy sessions' batched "
        "step, each tick of the restore; a deadline miss is a step that ended after the "
        "next frame was due (the replay before it overran).",
        "",
        gpu_estimate(model_name, 1000 * results[-1].b2b_s / results[-1].frames),
    ]
    text = "\n".join(body)
    print(text)
    write_section(
        "benchmarks.md",
        section,
        text,
        f"Restore through the tick stage: tiny {model_name} (`bench/restore_pace.py`)"
        + (f", {args.label}" if args.label else ""),
        docs=docs,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Full runs: HF_HUB_OFFLINE=1 .venv-moshi/bin/python -m bench.restore_pace "
        "--model moshi (about a minute); HF_HUB_OFFLINE=1 .venv-nemotron/bin/python -m "
        "bench.restore_pace --model nemotron (about 15 minutes: 10 minutes of history at "
        "13 ms a frame is 100 s back to back, and 2 restores of it through the stage); "
        "--sizes 250,1000 for a shorter one.",
    )
    parser.add_argument("--model", choices=MODELS, required=True, help="the tiny checkpoint")
    parser.add_argument(
        "--sizes",
        default=None,
        help=f"history lengths in frames, comma-separated (default {SIZES}; --quick: "
        f"{QUICK_SIZES})",
    )
    parser.add_argument(
        "--busy", type=int, default=2, help="live sessions beside the restore (default 2)"
    )
    parser.add_argument(
        "--base-frames",
        type=int,
        default=None,
        help="frames stepped live for the history, repeated to each length (default 250)",
    )
    parser.add_argument(
        "--window-ticks",
        type=int,
        default=None,
        help="ticks of the live steps alone before the restores (default 25; --quick 6)",
    )
    parser.add_argument(
        "--lost-s",
        type=float,
        default=1.0,
        help="how much shorter a failover-shaped history is (default 1 s)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the suite's run)")
    add_output_arguments(parser, "restore_pace")
    return parser.parse_args(argv)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(parse_args()))
