"""Tick time and deadline misses against sessions: the tick-batched stage, in real time.

For each level (a number of sessions) the program builds a frame-clocked model with that
many slots, opens every session on a `TickBatchedStagePort` (services/worker/stages/
tick_batched.py) as the worker does, and feeds each session real speech (harness/data's
"Hello there, can you hear me?" and a second of silence, over and over, each session at
its own offset) one frame at a time at real-time pace, one frame ahead of the clock like
a client's jitter buffer. It then lets the stage run for `--seconds` on the real clock
and reports, per level: the tick's step time (median, p90, max), the median as a share of
the frame (above 1 the model cannot keep up: every step overruns the next frame),
deadline misses, silence frames (a session's frame had not arrived when its tick came)
and input frames cut from the buffers (a client far ahead of a clock that fell behind).

Models, each measured where it can be built:
- `echo`: `EchoFrameModel` (harness/frame_models.py, numpy, no torch): the model costs
  nothing, so its figures are the stage's own cost per tick (gathering the frames, the hop
  to the model thread, the fan-out to the sessions).
- `moshi-tiny`: H1's tiny random Moshi-architecture model (a few layers, small dims, a
  small Mimi; `harness/tiny_moshi.py`) loaded by the moshi plugin, on CPU. Needs torch and
  kyutai's `moshi`: run the program with `.venv-moshi/bin/python`; from the main venv it
  is skipped, and said so.

Writes the `tick_batched` section of docs/benchmarks.md and, when the Moshi model was
measured, the `tick_models` table of docs/models.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.common import add_output_arguments, machine, now_utc, percentile, write_section
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.contracts import DuplexFence, FrameModel, StageOutput, StagePlan

#: ticks run before the measured window (model warm-up, the first allocations)
WARMUP_TICKS = 12
#: silence after each utterance of the speech sample, in seconds
PAUSE_S = 1.0


@dataclass
class LevelFigures:
    model: str
    sessions: int
    frame_ms: float
    ticks: int
    step_s: list[float] = field(default_factory=list)
    deadline_misses: int = 0
    silence_frames: int = 0
    dropped_frames: float = 0.0
    audio_frames: int = 0
    open_s: float = 0.0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_s) * 1000 if self.step_s else math.nan

    @property
    def p90_ms(self) -> float:
        return percentile(sorted(self.step_s), 0.90) * 1000 if self.step_s else math.nan

    @property
    def max_ms(self) -> float:
        return max(self.step_s) * 1000 if self.step_s else math.nan

    @property
    def ratio(self) -> float:
        return self.median_ms / self.frame_ms


@dataclass
class ModelKind:
    """How to build one kind of frame model with `slots` slots."""

    name: str
    label: str
    build: Callable[[int], FrameModel]
    close: Callable[[], None] = lambda: None


def speech_at(rate: int) -> np.ndarray:
    """The harness's speech sample at `rate`, followed by `PAUSE_S` of silence."""
    from harness.sessions import speech_wav
    from shared.protocol.duplex import StreamingResampler

    samples, source_rate = speech_wav()
    if source_rate != rate:
        resampler = StreamingResampler(source_rate, rate)
        samples = np.concatenate([resampler.process(samples), resampler.flush()])
    pause = np.zeros(int(PAUSE_S * rate), np.float32)
    return np.concatenate([samples.astype(np.float32), pause])


def echo_kind() -> ModelKind:
    from harness.frame_models import EchoFrameModel

    return ModelKind("echo", "EchoFrameModel (numpy: the stage's own cost)", EchoFrameModel)


def moshi_kind(threads: int) -> ModelKind | str:
    """The tiny Moshi model, or why it cannot be built in this interpreter."""
    try:
        import torch

        from harness.tiny_moshi import make_tiny_moshi
        from plugins.moshi import MoshiPlugin
    except ImportError as missing:
        return f"skipped: {missing} (run with .venv-moshi/bin/python)"
    directory = tempfile.TemporaryDirectory(prefix="tiny-moshi-")
    make_tiny_moshi(Path(directory.name))
    plugin = MoshiPlugin.from_options(
        {"model_dir": directory.name, "device": "cpu", "threads": str(threads)}
    )
    return ModelKind(
        "moshi-tiny",
        f"tiny random Moshi (plugins/moshi, CPU, torch {torch.__version__}, {threads} threads)",
        plugin.frame_model,
        directory.cleanup,
    )


async def feed(
    port: TickBatchedStagePort, session_id: str, audio: np.ndarray, offset: int, frame: int
) -> None:
    """One frame every frame period, on a fixed grid, starting one frame ahead."""
    period = frame / port.model.input_sample_rate_hz
    position = offset
    started = time.monotonic()
    for n in range(1_000_000):
        chunk = np.take(audio, range(position, position + frame), mode="wrap")
        position = (position + frame) % len(audio)
        port.feed(session_id, chunk.astype(np.float32))
        await asyncio.sleep(max(0.0, started + (n + 1) * period - time.monotonic()))


async def run_level(kind: ModelKind, sessions: int, seconds: float) -> LevelFigures:
    model = kind.build(sessions)
    port = TickBatchedStagePort(model, model_name=kind.name)
    frame = model.frame_samples
    audio = speech_at(model.input_sample_rate_hz)
    figures = LevelFigures(kind.name, sessions, model.frame_ms, 0)

    def sink(output: StageOutput) -> None:
        if output.kind == "audio":
            figures.audio_frames += 1

    feeders: list[asyncio.Task[None]] = []
    opened = time.perf_counter()
    for i in range(sessions):
        fence = DuplexFence(f"bench-tick-{i}", 1, 1)
        port.bind(fence.session_id, sink)
        request_id = await port.ensure(fence, "model")
        offset = (i * len(audio)) // sessions // frame * frame
        feeders.append(asyncio.create_task(feed(port, fence.session_id, audio, offset, frame)))
        await port.submit_initial(StagePlan(request_id, fence, "model", {}))
    figures.open_s = time.perf_counter() - opened
    try:
        await port.wait_ticks(WARMUP_TICKS)
        first = port.stats()
        start_ticks = port.ticks
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            seen = port.ticks
            await port.wait_ticks(seen + 1)
            if port.ticks == seen + 1:  # a tick we saw end: its step time is the last one
                figures.step_s.append(port.last_tick_s)
        last = port.stats()
        figures.ticks = port.ticks - start_ticks
        figures.deadline_misses = last["deadline_misses"] - first["deadline_misses"]
        figures.silence_frames = last["silence_frames"] - first["silence_frames"]
        figures.dropped_frames = last["dropped_input_frames"] - first["dropped_input_frames"]
    finally:
        for task in feeders:
            task.cancel()
        await asyncio.gather(*feeders, return_exceptions=True)
        await port.shutdown()
    return figures


def table(results: list[LevelFigures], seconds: float) -> list[str]:
    rows = [
        "| model | sessions | step time, median / p90 / max | median / frame "
        f"| ticks in {seconds:g} s | deadline misses | silence frames | input frames cut |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in results:
        rows.append(
            f"| {f.model} | {f.sessions} | {f.median_ms:.2f} / {f.p90_ms:.2f} / "
            f"{f.max_ms:.2f} ms | {f.ratio:.3f} | {f.ticks} | {f.deadline_misses} | "
            f"{f.silence_frames} | {f.dropped_frames:.0f} |"
        )
    return rows


async def main(args: argparse.Namespace) -> None:
    levels = [int(level) for level in args.levels.split(",")]
    kinds: list[ModelKind] = []
    notes: list[str] = []
    if "echo" in args.models:
        kinds.append(echo_kind())
    if "moshi-tiny" in args.models:
        moshi = moshi_kind(args.threads)
        if isinstance(moshi, str):
            notes.append(f"moshi-tiny: {moshi}")
        else:
            kinds.append(moshi)
    results: list[LevelFigures] = []
    for kind in kinds:
        try:
            for sessions in levels:
                figures = await run_level(kind, sessions, args.seconds)
                print(
                    f"{kind.name} x{sessions}: step {figures.median_ms:.2f} ms median, "
                    f"{figures.deadline_misses} misses, {figures.silence_frames} silence",
                    flush=True,
                )
                results.append(figures)
        finally:
            kind.close()
    python = ".venv-moshi/bin/python" if any(k.name == "moshi-tiny" for k in kinds) else "python"
    command = f"{python} -m bench.tick_batched --levels {args.levels} --seconds {args.seconds:g}"
    header = [
        f"Measured {now_utc()} on {machine()}: `{command}`.",
        "",
        *(f"- {kind.name}: {kind.label}" for kind in kinds),
        *(f"- {note}" for note in notes),
        "",
        "Each session is fed real speech one 80 ms frame at a time in real time; the step "
        "time is the model step of one tick for all sessions (gather to fan-out excluded).",
        "",
    ]
    body = "\n".join([*header, *table(results, args.seconds)])
    print(body)
    write_section(
        "benchmarks.md",
        args.section,
        body,
        "Frame-clocked models: tick time against sessions (`bench/tick_batched.py`)"
        + (f", {args.label}" if args.label else ""),
        docs=args.docs,
    )
    moshi_rows = [f for f in results if f.model == "moshi-tiny"]
    if moshi_rows:
        compact = "\n".join(
            [
                f"Measured {now_utc()} on {machine()}: `{command}`.",
                "",
                *table(moshi_rows, args.seconds),
            ]
        )
        write_section(
            "models.md", "tick_models", compact, "Frame-clocked models: measured", docs=args.docs
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--levels", default="1,2,4,8,16,32", help="sessions per level, comma-separated"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per level")
    parser.add_argument(
        "--models",
        default="echo,moshi-tiny",
        help="which models, comma-separated: echo, moshi-tiny (skipped without torch/moshi)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads for moshi-tiny")
    add_output_arguments(parser, "tick_batched")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(parser.parse_args()))
