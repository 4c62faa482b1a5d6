"""A model-native session's restore: replay time, deadline misses, checkpoint bytes.

A frame-clocked session's model memory is the history of its frames' records (the tokens
each step fed the LM: plugins/moshi/replay.py); a session moved to another worker gets its
slot back by replaying that history in chunks between the ticks' steps
(`restore_slot`, `replay_work`; services/worker/stages/tick_batched.py). Measured on the
tiny random Moshi of harness/tiny_moshi.py (greedy, CPU), through the moshi plugin:

1. Restore time against frames restored. One slot of a model of its own is stepped on
   noise for the largest N, its records kept; for each N, the first N records are restored
   into a slot of a model whose `--busy` other slots are open and stepped (their key/value
   rings wrapped: past the model's context) with one step of theirs between chunks, as the
   stage does. Reported: the replay's seconds (`restore_slot` and every `replay_work`, the
   steps between them excluded; `replay_chunk_frames` a call), its chunks, frames per
   second, and the floor a restore without records would cost: stepping the same N
   frames one by one, in a batch of one.
2. Deadline misses during a restore on the real stage: a `TickBatchedStagePort` on the
   real clock, `--busy` sessions fed speech in real time, then one more session restored
   from a history (`keep_history` + `submit_initial`, as a worker does for a moved
   session); deadline misses and step times before, during and after the restore.
3. Checkpoint bytes per minute of conversation: a record's bytes (`state_record_bytes`)
   times the frames of a minute, for the tiny model and, computed from moshi's published
   7B config (not measured), for Moshi-7B.

Needs torch and kyutai's `moshi`: run with `.venv-moshi/bin/python -m bench.native_restore`.
Writes the `native_restore` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import add_output_arguments, machine, now_utc, write_section

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: steps of the busy slots before anything is measured: past the tiny model's context, so
#: their rings have wrapped (a restore must not disturb a wrapped neighbour)
BUSY_WARM_FRAMES = 120
#: ticks the stage runs before its first measured window
WARMUP_TICKS = 12
#: frames of the small history restored (untimed) before the measured ones: the first
#: replay allocates and warms kernels
WARM_RESTORE_FRAMES = 8


@dataclass
class RestoreFigures:
    frames: int
    replay_s: float
    chunks: int
    chunk_s: list[float]
    stepping_s: float

    @property
    def frames_per_s(self) -> float:
        return self.frames / self.replay_s

    @property
    def ratio(self) -> float:
        return self.stepping_s / self.replay_s


@dataclass
class Phase:
    """One window of the stage's ticks."""

    name: str
    ticks: int = 0
    misses: int = 0
    step_s: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_s) * 1000 if self.step_s else float("nan")

    @property
    def max_ms(self) -> float:
        return max(self.step_s) * 1000 if self.step_s else float("nan")


@dataclass
class StageFigures:
    history_frames: int
    busy: int
    frame_ms: float
    phases: list[Phase]
    restore_s: float
    open_s: float
    chunks: int
    restored_frames: int


class TinyMoshi:
    """The tiny random checkpoint in a temporary folder, and greedy models made from it."""

    def __init__(self, chunk: int, threads: int) -> None:
        from harness.tiny_moshi import make_tiny_moshi
        from plugins.moshi import MoshiPlugin

        self._directory = tempfile.TemporaryDirectory(prefix="tiny-moshi-")
        make_tiny_moshi(Path(self._directory.name))
        self.plugin = MoshiPlugin.from_options(
            {
                "model_dir": self._directory.name,
                "device": "cpu",
                "temperature": "0",
                "temperature_text": "0",
                "threads": str(threads),
                "replay_chunk_frames": str(chunk),
            }
        )

    def model(self, slots: int) -> Any:
        return self.plugin.frame_model(slots)

    def close(self) -> None:
        self._directory.cleanup()


def context_frames(model: Any) -> int:
    """The LM transformer's attention context, in frames."""
    from moshi.modules.transformer import StreamingMultiheadAttention

    contexts = [
        module.context
        for module in model.lm.transformer.modules()
        if isinstance(module, StreamingMultiheadAttention) and module.context
    ]
    return max(contexts)


def noise(rng: np.random.Generator, rows: int, samples: int) -> np.ndarray:
    return (0.2 * rng.standard_normal((rows, samples))).astype(np.float32)


def make_history(tiny: TinyMoshi, frames: int) -> tuple[bytes, list[float]]:
    """One slot stepped `frames` times on noise in a batch of one: its records, and how long
    each step took (the floor a restore without records would cost)."""
    model = tiny.model(1)
    rng = np.random.default_rng(1)
    active = np.ones(1, dtype=bool)
    model.open_slot(0, {})
    records, step_s = bytearray(), []
    for _ in range(frames):
        frame = noise(rng, 1, model.frame_samples)
        started = time.perf_counter()
        output = model.step(frame, active)[0]
        step_s.append(time.perf_counter() - started)
        records += output.record
    model.close()
    return bytes(records), step_s


def measure_restores(
    tiny: TinyMoshi, history: bytes, step_s: list[float], sizes: list[int], busy: int
) -> list[RestoreFigures]:
    """Each size restored into slot 0 while slots 1..busy are stepped between its chunks."""
    model = tiny.model(busy + 1)
    record = model.state_record_bytes
    rng = np.random.default_rng(2)
    active = np.zeros(model.slots, dtype=bool)
    active[1:] = True
    for slot in range(1, model.slots):
        model.open_slot(slot, {})
    for _ in range(BUSY_WARM_FRAMES):
        model.step(noise(rng, model.slots, model.frame_samples), active)

    def restore(frames: int) -> tuple[float, list[float]]:
        started = time.perf_counter()
        model.restore_slot(0, {}, history[: frames * record])
        opened = time.perf_counter() - started
        chunk_s = []
        while model.replay_pending(0):
            model.step(noise(rng, model.slots, model.frame_samples), active)
            started = time.perf_counter()
            model.replay_work(0, model.replay_chunk_frames)
            chunk_s.append(time.perf_counter() - started)
        both = active.copy()
        both[0] = True  # the restored slot steps with the others: the restore is whole
        model.step(noise(rng, model.slots, model.frame_samples), both)
        model.close_slot(0)
        return opened, chunk_s

    restore(WARM_RESTORE_FRAMES)
    results = []
    for frames in sizes:
        opened, chunk_s = restore(frames)
        results.append(
            RestoreFigures(
                frames, opened + sum(chunk_s), len(chunk_s), chunk_s, sum(step_s[:frames])
            )
        )
    model.close()
    return results


async def feed(port: Any, session_id: str, audio: np.ndarray, offset: int) -> None:
    """One frame every frame period on a fixed grid, one frame ahead of the clock."""
    frame = port.model.frame_samples
    period = frame / port.model.input_sample_rate_hz
    position, started = offset, time.monotonic()
    for n in range(10_000_000):
        port.feed(session_id, np.take(audio, range(position, position + frame), mode="wrap"))
        position = (position + frame) % len(audio)
        await asyncio.sleep(max(0.0, started + (n + 1) * period - time.monotonic()))


async def window(port: Any, phase: Phase, seconds: float) -> None:
    """The ticks of the next `seconds` into `phase`."""
    first = port.counters.deadline_misses
    start = port.ticks
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen = port.ticks
        await port.wait_ticks(seen + 1)
        if port.ticks == seen + 1:  # the tick we waited for: its step is the last one
            phase.step_s.append(port.last_tick_s)
    phase.ticks = port.ticks - start
    phase.misses = port.counters.deadline_misses - first


async def measure_stage(tiny: TinyMoshi, history: bytes, busy: int, seconds: float) -> StageFigures:
    """`busy` sessions in real time, then one restored from `history`; the ticks before,
    during and after its restore."""
    from bench.tick_batched import speech_at
    from services.worker.stages.tick_batched import TickBatchedStagePort
    from shared.contracts import DuplexFence, ModelHistory, StagePlan

    model = tiny.model(busy + 1)
    port = TickBatchedStagePort(model, model_name="moshi-tiny")
    audio = speech_at(model.input_sample_rate_hz)
    frame = model.frame_samples
    feeders: list[asyncio.Task[None]] = []
    before, during, after = Phase("before"), Phase("during"), Phase("after")
    history_frames = len(history) // model.state_record_bytes

    async def open_session(index: int, kept: ModelHistory | None) -> None:
        fence = DuplexFence(f"bench-restore-{index}", 1, 1)
        port.bind(fence.session_id, lambda output: None)
        request_id = await port.ensure(fence, "model")
        if kept is not None:
            port.keep_history(fence.session_id, kept, responding=False)
        offset = (index * len(audio)) // (busy + 1) // frame * frame
        feeders.append(asyncio.create_task(feed(port, fence.session_id, audio, offset)))
        await port.submit_initial(StagePlan(request_id, fence, "model", {}))

    try:
        for index in range(busy):
            await open_session(index, None)
        await port.wait_ticks(port.ticks + WARMUP_TICKS)
        await window(port, before, seconds)

        first_misses, first_ticks = port.counters.deadline_misses, port.ticks
        first_chunks = port.counters.replay_chunks
        started = time.perf_counter()
        await open_session(busy, ModelHistory(model.state_record_bytes, history))
        open_s = time.perf_counter() - started
        while port.counters.restores < 1:
            seen = port.ticks
            await port.wait_ticks(seen + 1)
            if port.ticks == seen + 1:
                during.step_s.append(port.last_tick_s)
        # the replay ended after the tick before the one just seen; that tick is counted
        # too (a chunk that overran would make it late)
        during.ticks = port.ticks - first_ticks
        during.misses = port.counters.deadline_misses - first_misses
        chunks = port.counters.replay_chunks - first_chunks

        await window(port, after, seconds)
        return StageFigures(
            history_frames,
            busy,
            model.frame_ms,
            [before, during, after],
            port.counters.last_restore_s,
            open_s,
            chunks,
            port.counters.restored_frames,
        )
    finally:
        for task in feeders:
            task.cancel()
        await asyncio.gather(*feeders, return_exceptions=True)
        await port.shutdown()


def bytes_per_minute(record_bytes: int, frame_ms: float) -> float:
    return record_bytes * 60_000 / frame_ms


def moshi_7b_layout() -> tuple[int, int, float, int]:
    """Moshi-7B's record: (codebooks, bytes, frame rate Hz, context frames), from moshi's
    published 7B config (`moshi.models.loaders._lm_kwargs`, kyutai/moshiko): text + n_q
    audio codebooks and the barge-in's silence, two bytes each (plugins/moshi/replay.py)."""
    from moshi.models import loaders

    codebooks = 1 + int(loaders._lm_kwargs["n_q"])
    record = 2 * (codebooks + 1)
    return codebooks, record, float(loaders.FRAME_RATE), int(loaders._lm_kwargs["context"])


def restore_table(results: list[RestoreFigures], frame_ms: float) -> list[str]:
    rows = [
        "| frames restored | conversation | replay | chunks | chunk median / max "
        "| last chunk | frames/s | stepping the same frames | stepping / replay |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in results:
        chunks = sorted(f.chunk_s[:-1]) or [float("nan")]
        rows.append(
            f"| {f.frames} | {f.frames * frame_ms / 1000:.0f} s | {f.replay_s * 1000:.1f} ms "
            f"| {f.chunks} | {statistics.median(chunks) * 1000:.2f} / "
            f"{chunks[-1] * 1000:.2f} ms | {f.chunk_s[-1] * 1000:.2f} ms "
            f"| {f.frames_per_s:,.0f} | {f.stepping_s:.2f} s | {f.ratio:.0f}x |"
        )
    return rows


def stage_table(stage: StageFigures) -> list[str]:
    rows = [
        "| phase | ticks | deadline misses | step time, median / max |",
        "|---|---|---|---|",
    ]
    for phase in stage.phases:
        rows.append(
            f"| {phase.name} | {phase.ticks} | {phase.misses} "
            f"| {phase.median_ms:.2f} / {phase.max_ms:.2f} ms |"
        )
    return rows


def bytes_table(tiny_bytes: int, tiny_frame_ms: float) -> list[str]:
    codebooks, record, rate, _ = moshi_7b_layout()
    frame_ms = 1000 / rate
    rows = [
        "| model | record | frames per minute | bytes per minute | per hour | how |",
        "|---|---|---|---|---|---|",
    ]
    for name, size, ms, how in [
        ("tiny Moshi (harness)", tiny_bytes, tiny_frame_ms, "the model's `state_record_bytes`"),
        (
            f"Moshi-7B ({codebooks} tokens + silence)",
            record,
            frame_ms,
            "computed from moshi's published 7B config, not measured",
        ),
    ]:
        per_minute = bytes_per_minute(size, ms)
        rows.append(
            f"| {name} | {size} B | {60_000 / ms:.0f} | {per_minute / 1000:.1f} KB "
            f"| {per_minute * 60 / 1e6:.2f} MB | {how} |"
        )
    return rows


async def main(args: argparse.Namespace) -> None:
    quick = args.quick
    sizes = [int(n) for n in (args.frames or ("20,120" if quick else "250,1000,3000")).split(",")]
    chunk = args.chunk or (16 if quick else 64)
    busy = args.busy if args.busy is not None else (2 if quick else 8)
    stage_frames = args.stage_history or (120 if quick else 1000)
    seconds = args.seconds or (0.3 if quick else 1.0)

    import torch

    load_at_start = os.getloadavg()[0]
    tiny = TinyMoshi(chunk, args.threads)
    try:
        history, step_s = make_history(tiny, max([*sizes, stage_frames]))
        print(
            f"history: {len(step_s)} frames stepped, {statistics.median(step_s) * 1000:.2f} ms "
            "a step (median)",
            flush=True,
        )
        restores = measure_restores(tiny, history, step_s, sizes, busy)
        for f in restores:
            print(
                f"restore {f.frames} frames: {f.replay_s * 1000:.1f} ms in {f.chunks} chunks, "
                f"{f.frames_per_s:,.0f} frames/s; stepping them {f.stepping_s:.2f} s "
                f"({f.ratio:.0f}x)",
                flush=True,
            )
        probe = tiny.model(1)
        frame_ms, record_bytes = probe.frame_ms, probe.state_record_bytes
        context = context_frames(probe)
        probe.close()
        stage = await measure_stage(tiny, history[: stage_frames * record_bytes], busy, seconds)
    finally:
        tiny.close()
    before, during, after = stage.phases
    print(
        f"stage: restore of {stage.history_frames} frames in {stage.restore_s:.3f} s, "
        f"{during.ticks} ticks, misses before/during/after {before.misses}/{during.misses}/"
        f"{after.misses}",
        flush=True,
    )
    _, _, rate_7b, context_7b = moshi_7b_layout()
    past = [n for n in sizes if n > context]
    command = ".venv-moshi/bin/python -m bench.native_restore" + (" --quick" if quick else "")
    if args.frames:
        command += f" --frames {args.frames}"
    for flag, value in [
        ("--chunk", args.chunk),
        ("--busy", args.busy),
        ("--stage-history", args.stage_history),
        ("--seconds", args.seconds),
    ]:
        if value is not None:
            command += f" {flag} {value:g}"
    body = [
        f"Measured {now_utc()} on {machine()}: `{command}`. Load average (1 min) "
        f"{load_at_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end: the "
        "machine's other work shares its cores with the steps and the replay.",
        "",
        f"The tiny random Moshi of `harness/tiny_moshi.py` (plugins/moshi, CPU, torch "
        f"{torch.__version__}, {args.threads} thread{'s' if args.threads != 1 else ''}, "
        f"greedy), {frame_ms:g} ms frames, "
        f"{record_bytes}-byte records (text + {record_bytes // 2 - 2} audio codebooks + "
        "the barge-in's silence), "
        f"replay chunks of {chunk} frames, {busy} other slots busy.",
        "",
        "**Restore time against frames restored.** One slot stepped on noise in a batch of "
        "one; its first N records restored into a slot of a model whose other slots are "
        "open, past their context, and stepped between the chunks (as the stage does). "
        "*Replay* is `restore_slot` plus every `replay_work` until done (the commit into "
        "the batch and the decoder's warm-up included; the others' steps between chunks "
        "excluded); the *chunk* columns are the chunks before the last, which is a chunk "
        "plus the commit and the decoder's warm-up; *stepping the same frames* is the "
        "floor a restore without records would cost: the same N frames stepped one by "
        "one (Mimi encode, LM, depformer, Mimi decode), in a batch of one. The tiny LM's "
        f"context is {context} frames"
        + (
            f", so {', '.join(str(n) for n in past)} frames are past it: the replay's "
            "chunks stay exact there (a side ring of context + chunk - 1), and its cost "
            "grows with the frames, not with their square"
            if past
            else ""
        )
        + f". Moshi-7B's context is {context_7b} frames ({context_7b / rate_7b / 60:g} min).",
        "",
        *restore_table(restores, frame_ms),
        "",
        f"**Deadline misses during a restore, on the real stage.** A `TickBatchedStagePort` "
        f"on the real clock, {busy} sessions fed speech in real time, then one session "
        f"restored from a {stage.history_frames}-frame history (`keep_history` + "
        f"`submit_initial`, as a worker does for a moved session); the stage replays after "
        "each tick's step as many frames as its measured cost fits in the time before the "
        "next frame (one at least). The restore "
        f"took {stage.restore_s * 1000:.0f} ms ({stage.chunks} chunks; "
        f"`submit_initial`, which decodes the history and opens the slot, "
        f"{stage.open_s * 1000:.1f} ms); {stage.restored_frames} frames restored. "
        "*During* runs from `submit_initial` to the tick after the last chunk.",
        "",
        *stage_table(stage),
        "",
        "**Checkpoint bytes per minute of conversation**: a record (two bytes a field) "
        "times the frames of a minute; what the worker appends to Redis for a session, "
        "about once a second.",
        "",
        *bytes_table(record_bytes, frame_ms),
    ]
    text = "\n".join(body)
    print(text)
    write_section(
        "benchmarks.md",
        args.section,
        text,
        "Model-native restore: replay time, deadline misses, checkpoint bytes "
        "(`bench/native_restore.py`)" + (f", {args.label}" if args.label else ""),
        docs=args.docs,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--frames",
        default=None,
        help="history sizes to restore, comma-separated (default 250,1000,3000; --quick: 20,120)",
    )
    parser.add_argument(
        "--chunk", type=int, default=None, help="replay chunk, frames (default 64; --quick: 16)"
    )
    parser.add_argument(
        "--busy", type=int, default=None, help="other slots busy (default 8; --quick: 2)"
    )
    parser.add_argument(
        "--stage-history",
        type=int,
        default=None,
        help="frames of the history restored on the stage (default 1000; --quick: 120)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="the stage's window before and after the restore (default 1; --quick: 0.3)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine, cores busy elsewhere stall a "
        "multi-threaded step)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (the suite's run)")
    add_output_arguments(parser, "native_restore")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(parser.parse_args()))
