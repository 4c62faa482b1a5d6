"""Sessions per GPU for the Moshi family: a Moshi-7B-shaped model on the real tick stage.

Builds the language model of moshiko's published config (`moshi.models.loaders._lm_kwargs`:
7.69 B parameters, 32 layers of dim 4096, a depformer of 6 layers over 8 codebooks, context
3000 frames) with `LMModel(**kwargs, device=..., dtype=torch.bfloat16)`: random weights
made by moshi's own initialisation on the device itself (no state dict in host memory),
and Mimi as `loaders.get_mimi` builds it (float32, random codebooks), then serves them
through our own code: `MoshiFrameModel` (plugins/moshi) on a `TickBatchedStagePort`
(services/worker/stages/tick_batched.py), driven by `bench.tick_batched.run_level`, the
same real-time driver as bench/tick_batched.py (every session fed speech one 80 ms frame at
a time on the real clock; the stage's own counters give the deadline misses).

For each level (sessions) and each CUDA-graph mode it reports the batched step's time
(median, p90, p99, max), the median's share of the 80 ms frame, deadline misses, silence
frames, input frames cut, and GPU memory: the peak allocated during the level
(`torch.cuda.max_memory_allocated`), and per slot (that peak less what was allocated
before the level, divided by the sessions). CUDA graphs: moshi 0.2.13 wraps `LMGen`'s
transformer step and depformer, Mimi's encoder and decoder and the streaming modules'
exec-mask setters in `moshi.utils.compile.CUDAGraphed` whenever the model is on CUDA (what
`moshi.server` runs); "off" runs the same inside `moshi.utils.compile.no_cuda_graph()`
(the switch the environment variable NO_CUDA_GRAPH=1 also throws).

Then a restore (plugins/moshi/replay.py: `restore_slot` + `replay_work(slot, frames)`, the
slot's history forwarded in a side batch, `--chunk` frames a call, the most one may take: the
model's `replay_chunk_frames`) of 250, 1000 and 3000 frames, timed with 8 other slots
busy (`bench.native_restore.measure_restores`), and the deadline misses of 32 busy slots on
the real stage while one more is restored from a 3000-frame history
(`bench.native_restore.measure_stage`). The histories are random valid tokens: a replay's
cost does not depend on their values (tests/plugins/moshi prove a replay exact on the tiny model).

Each part (the sweep with graphs on, with graphs off, the restore) runs in a process of its
own, under a share of `--budget-s`: a part that fails (a CUDA graph that cannot be captured,
a crash) is recorded and the others still run. Within a sweep, a level that runs out of
memory or fails is recorded and ends that sweep; a level that would pass the part's time
budget is recorded as skipped. Results are written as they come, so a run cut short still
leaves what it measured.

Writes to `--out DIR` (default `$OUT`, else test-artifacts/gpu_native): gpu_native.json,
gpu_native.png (step time and deadline misses against sessions; needs matplotlib) and
gpu_native.md (the tables). `--write-docs` also writes the `gpu_native` section of
docs/benchmarks.md and docs/img/gpu_native.png; `--from-json FILE` renders those from an
earlier run's JSON (one fetched back from a GPU machine) without measuring.

`--tiny` runs harness/tiny_moshi.py's tiny random checkpoint instead (what CPU runs and
the tests use). Needs torch and kyutai's `moshi` (`.venv-moshi`); on a GPU machine that
reaches no registry, bench/gpu_native.sh brings the wheels. `--help` needs neither.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import DOCS, ROOT, add_output_arguments, machine, now_utc, percentile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FRAME_MS = 80.0
#: the GPU sweep's levels; "max" adds levels past the last while the GPU's memory holds them
GPU_LEVELS = "1,8,16,32,48,64,max"
TINY_LEVELS = "1,2,4"
#: levels added by "max": multiples of this past the last given level...
MAX_STEP = 16
#: ...and the largest multiple of this predicted to fit
MAX_ROUND = 4
#: share of the GPU's memory a predicted level may use
MEMORY_HEADROOM = 0.95
#: a "max" level whose median step is past this share of the frame ends the sweep
MAX_SHARE = 1.25
#: the restore part's share of the budget, in seconds
RESTORE_BUDGET_S = 110.0
#: the least a part is given, whatever the parts before it used
MIN_PART_S = 30.0
#: how long past its budget a part may run before it is killed (it stops itself sooner)
PART_GRACE_S = 30.0
#: when this process started: a part's budget counts from here
STARTED = time.monotonic()
OUT_FILES = ("gpu_native.json", "gpu_native.png", "gpu_native.md")
STAGE_LOGGER = "services.worker.stages.tick_batched"


# ------------------------------------------------------------------ the model


class Models:
    """One LM, Mimi and tokenizer on the device, and `MoshiFrameModel`s of any number of
    slots made from them, one at a time (`model(slots)` releases the previous one's
    streaming state: its key/value cache and CUDA graphs)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.chunk = args.chunk
        self.tiny = args.tiny
        self._directory: tempfile.TemporaryDirectory[str] | None = None
        self.current: Any = None
        self.after_build = 0  # memory allocated once the last model was built and warm
        if not self.cuda:
            from plugins.moshi.frame_model import default_threads

            torch.set_num_threads(args.threads or default_threads())
        started = time.perf_counter()
        if args.tiny:
            self._load_tiny(args.context)
        else:
            self._build_7b(args.context, args.seed)
        self.build_s = time.perf_counter() - started
        self.weights_bytes = memory_allocated(torch) if self.cuda else None

    def _load_tiny(self, context: int | None) -> None:
        """The tiny checkpoint, loaded by the plugin's own loading code."""
        from harness.tiny_moshi import make_tiny_moshi
        from plugins.moshi.checkpoint import MoshiCheckpoint
        from plugins.moshi.frame_model import sampling_from_config

        torch = self.torch
        self._directory = tempfile.TemporaryDirectory(prefix="tiny-moshi-")
        extra = {"context": context} if context else {}
        checkpoint = MoshiCheckpoint.open(make_tiny_moshi(Path(self._directory.name), **extra))
        dtype = torch.bfloat16 if self.cuda else torch.float32
        self.lm = checkpoint.load_lm(self.device, dtype)
        self.mimi = checkpoint.load_mimi(self.device)
        self.tokenizer = checkpoint.load_tokenizer()
        self.sampling = sampling_from_config(checkpoint.info.lm_gen_config)
        self.lm_kwargs = dict(checkpoint.info.lm_config or {})
        self.shape = "tiny"

    def _build_7b(self, context: int | None, seed: int) -> None:
        """moshiko's published config, random weights initialised on the device in bf16."""
        import sentencepiece
        from moshi.models import loaders
        from moshi.models.lm import LMModel

        from harness.tiny_moshi import _randomize_quantizer, train_tokenizer
        from plugins.moshi.frame_model import SamplingSettings

        torch = self.torch
        kwargs = dict(loaders._lm_kwargs)
        if context:
            kwargs["context"] = context
        torch.manual_seed(seed)
        with torch.no_grad():
            self.lm = LMModel(device=self.device, dtype=torch.bfloat16, **kwargs).eval()
            self.mimi = loaders.get_mimi(None, device=self.device, num_codebooks=kwargs["dep_q"])
            # moshi's codebooks start as zeros (k-means fills them in training)
            _randomize_quantizer(self.mimi, torch.Generator().manual_seed(seed))
        # the text tokenizer only turns text tokens into words (a few tokens here: the rest
        # are no words, so the random model's frames are mostly not "speaking")
        self._directory = tempfile.TemporaryDirectory(prefix="moshi-7b-")
        path = Path(self._directory.name) / loaders.TEXT_TOKENIZER_NAME
        train_tokenizer(path)
        self.tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.sampling = SamplingSettings()  # moshi's defaults: 0.8 / 0.7, top-k 250 / 25
        self.lm_kwargs = kwargs
        self.shape = "moshi-7b"

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.lm.parameters())

    @property
    def context(self) -> int:
        return int(self.lm_kwargs.get("context") or 0)

    def kv_bytes_per_slot(self) -> int:
        """The LM's key/value cache per slot, from its config: layers x (K, V) x dim x
        context x bytes per value."""
        element = 2 if self.cuda else 4
        layers, dim = int(self.lm_kwargs["num_layers"]), int(self.lm_kwargs["dim"])
        return layers * 2 * dim * self.context * element

    def model(self, slots: int) -> Any:
        """A warm `MoshiFrameModel` of `slots` slots (the previous one released first)."""
        from plugins.moshi.frame_model import MoshiFrameModel

        self.release()
        model = MoshiFrameModel(
            self.lm,
            self.mimi,
            self.tokenizer,
            slots,
            self.sampling,
            replay_chunk_frames=self.chunk,
        )
        self.current = model
        model.warm_up()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.after_build = memory_allocated(self.torch)
        else:
            self.after_build = rss_bytes()
        return model

    def graphs_captured(self) -> bool | None:
        """Whether the current model's LM step runs as a captured CUDA graph."""
        state = getattr(getattr(self.current, "lm_gen", None), "_streaming_state", None)
        graphed = getattr(state, "graphed_main", None)
        return None if graphed is None else graphed._graph is not None

    def release(self) -> None:
        """The current model's streaming state (key/value caches, CUDA graphs) let go, so
        the LM and Mimi can stream again with another batch."""
        model, self.current = self.current, None
        if model is not None:
            with contextlib.suppress(Exception):
                model.lm_gen._stop_streaming()
        for module in (self.lm, self.mimi):
            if module.is_streaming:
                module._stop_streaming()
        del model
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def close(self) -> None:
        self.release()
        if self._directory is not None:
            self._directory.cleanup()


def memory_allocated(torch: Any) -> int:
    return int(torch.cuda.memory_allocated())


def rss_bytes() -> int:
    from bench.common import rss_bytes as rss_of

    return rss_of(os.getpid())


def device_info(torch: Any, device: Any) -> dict[str, Any]:
    import moshi

    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "moshi": getattr(moshi, "__version__", "?"),
        "python": platform.python_version(),
        "host": machine(),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info.update(
            gpu=properties.name,
            gpu_memory_bytes=int(total),
            gpu_free_at_start_bytes=int(free),
            multiprocessors=properties.multi_processor_count,
            cuda=torch.version.cuda,
        )
    return info


# ------------------------------------------------------------------ the parts


@contextlib.contextmanager
def graphs(mode: str) -> Iterator[bool]:
    """moshi's CUDA graphs as `mode` says ("off": inside `no_cuda_graph()`); yields
    whether they are enabled."""
    from moshi.utils import compile as moshi_compile

    if mode == "off":
        with moshi_compile.no_cuda_graph():
            yield moshi_compile._is_cuda_graph_enabled()
    else:
        yield moshi_compile._is_cuda_graph_enabled()


class StageErrors(logging.Handler):
    """Errors the stage logs (a failed step is logged, and the clock goes on)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0
        self.first = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if not self.first:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text += f": {record.exc_info[1]!r}"
            self.first = text[:500]


class Results:
    """A part's results, written to its file after every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"levels": [], "notes": []}

    def save(self) -> None:
        self.path.write_text(json.dumps(clean(self.data), indent=1))


def clean(value: Any) -> Any:
    """NaN and infinities as null (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def is_oom(error: BaseException | str) -> bool:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return "out of memory" in text.lower() or "OutOfMemoryError" in text


def parse_levels(text: str) -> tuple[list[int], bool]:
    """'1,8,16,max' -> ([1, 8, 16], True)."""
    levels, more = [], False
    for item in text.split(","):
        item = item.strip()
        if item == "max":
            more = True
        elif item:
            levels.append(int(item))
    return sorted(set(levels)), more


def next_levels(models: Models, last: dict[str, Any], total: int) -> list[int]:
    """Levels past `last` (an ok level) predicted to fit the GPU's memory: multiples of
    MAX_STEP, and the largest multiple of MAX_ROUND."""
    per_slot = last["memory"].get("per_slot_bytes")
    base = models.weights_bytes
    if not per_slot or base is None:
        return []
    fits = int((total * MEMORY_HEADROOM - base) // per_slot)
    start = last["sessions"]
    levels = list(range((start // MAX_STEP + 1) * MAX_STEP, fits + 1, MAX_STEP))
    largest = fits // MAX_ROUND * MAX_ROUND
    if largest > start and largest not in levels:
        levels.append(largest)
    return sorted(levels)


async def run_sweep(args: argparse.Namespace, results: Results) -> None:
    """One CUDA-graph mode over the levels, each on the real stage for `--steps` frames."""
    from bench.tick_batched import ModelKind

    deadline = STARTED + args.part_budget_s if args.part_budget_s else math.inf
    models = Models(args)
    torch = models.torch
    results.data.update(model_record(models), device=device_info(torch, models.device))
    results.save()
    print(
        f"[{args.part}] {models.shape}: {models.parameters:,} parameters built in "
        f"{models.build_s:.1f} s",
        flush=True,
    )
    kind = ModelKind(f"moshi-{models.shape}", models.shape, models.model)
    seconds = args.steps * FRAME_MS / 1000
    levels, more = parse_levels(args.levels)
    total = torch.cuda.mem_get_info(models.device)[1] if models.cuda else 0
    if more and not models.cuda:
        results.data["notes"].append('"max" levels need a GPU\'s memory to size them: ignored')
        more = False
    errors = StageErrors()
    logging.getLogger(STAGE_LOGGER).addHandler(errors)
    level_s = 0.0  # how long the last level took, all told
    queue, extended = list(levels), False
    try:
        while queue:
            sessions = queue.pop(0)
            row: dict[str, Any] = {"mode": args.mode, "sessions": sessions, "status": "running"}
            results.data["levels"].append(row)
            results.save()
            needed = max(level_s * 1.2, seconds + 5)
            if time.monotonic() + needed > deadline:
                row.update(status="skipped", error="past this part's time budget (--budget-s)")
                results.save()
                print(f"[{args.part}] x{sessions}: skipped (time budget)", flush=True)
                break
            started = time.monotonic()
            ok = await measure_level(models, kind, sessions, seconds, args.mode, row, errors)
            level_s = time.monotonic() - started
            results.save()
            if not ok:
                break
            if not queue and more and not extended:
                extended = True
                queue = next_levels(models, row, total)
                results.data["notes"].append(f"levels added to fit the GPU's memory: {queue}")
            if extended and row["frame_share"] > MAX_SHARE:
                results.data["notes"].append(
                    f"the sweep stopped at {sessions} sessions: the step is past "
                    f"{MAX_SHARE:g} frames"
                )
                break
    finally:
        logging.getLogger(STAGE_LOGGER).removeHandler(errors)
        results.save()
        models.close()


async def measure_level(
    models: Models,
    kind: Any,
    sessions: int,
    seconds: float,
    mode: str,
    row: dict[str, Any],
    errors: StageErrors,
) -> bool:
    """One level into `row`; False when it failed (the sweep ends)."""
    from bench.tick_batched import run_level

    torch = models.torch
    models.release()
    before = memory_allocated(torch) if models.cuda else rss_bytes()
    if models.cuda:
        torch.cuda.reset_peak_memory_stats(models.device)
    errors.count, errors.first = 0, ""
    started = time.perf_counter()
    try:
        with graphs(mode) as enabled:
            figures = await run_level(kind, sessions, seconds)
            row["graphs_enabled"] = enabled
            row["graphs_captured"] = models.graphs_captured() if models.cuda else False
    except Exception as error:  # an OOM at the build, a graph that cannot be captured
        row.update(status="oom" if is_oom(error) else "error", error=f"{error!r}"[:800])
        print(f"[{mode}] x{sessions}: {row['status']}: {row['error'][:200]}", flush=True)
        with contextlib.suppress(Exception):  # the part may be past saving (its CUDA context)
            models.release()
        return False
    row["seconds"] = round(time.perf_counter() - started, 2)
    steps = sorted(figures.step_s)
    row.update(
        status="ok",
        ticks=figures.ticks,
        step_ms={
            "median": figures.median_ms,
            "p90": figures.p90_ms,
            "p99": percentile(steps, 0.99) * 1000 if steps else math.nan,
            "max": figures.max_ms,
        },
        frame_share=figures.ratio,
        deadline_misses=figures.deadline_misses,
        silence_frames=figures.silence_frames,
        input_frames_cut=round(figures.dropped_frames),
        open_s=round(figures.open_s, 3),
        step_failures=errors.count,
    )
    if models.cuda:
        peak = int(torch.cuda.max_memory_allocated(models.device))
        row["memory"] = {
            "kind": "cuda",
            "before_bytes": before,
            "after_build_bytes": models.after_build,
            "peak_allocated_bytes": peak,
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(models.device)),
            "per_slot_bytes": (peak - before) / sessions,
        }
    else:
        row["memory"] = {
            "kind": "rss",
            "before_bytes": before,
            "after_build_bytes": models.after_build,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            # the process's growth is the allocator's, not the slots': no figure per slot
            "per_slot_bytes": None,
        }
    if errors.count:
        row.update(status="oom" if is_oom(errors.first) else "step_failed", error=errors.first)
    models.release()
    print(
        f"[{mode}] x{sessions}: step {row['step_ms']['median']:.2f} ms median, "
        f"p99 {row['step_ms']['p99']:.2f} ms, {row['deadline_misses']} misses in "
        f"{row['ticks']} ticks, {size(row['memory']['per_slot_bytes'])} a slot",
        flush=True,
    )
    return row["status"] == "ok"


async def run_restore(args: argparse.Namespace, results: Results) -> None:
    """Restore times, and the stage's deadline misses while one slot restores."""
    import numpy as np

    from bench.native_restore import measure_restores, measure_stage
    from plugins.moshi.replay import encode_records, record_bytes

    models = Models(args)
    torch = models.torch
    results.data.update(model_record(models), device=device_info(torch, models.device))
    sizes = [int(n) for n in args.restore_frames.split(",")]
    restore: dict[str, Any] = {
        "mode": args.mode,
        "chunk_frames": args.chunk,
        "busy": args.restore_busy,
        "stage_busy": args.stage_busy,
        "stage_history_frames": args.stage_history,
        "status": "running",
    }
    results.data["restore"] = restore
    results.save()
    try:
        with graphs(args.mode) as enabled:
            restore["graphs_enabled"] = enabled
            floor_s = step_floor(models)
            restore["step_floor_ms"] = floor_s * 1000
            lm = models.lm
            frames = max([*sizes, args.stage_history])
            rng = np.random.default_rng(3)
            tokens = rng.integers(0, lm.card, size=(frames, lm.num_codebooks))
            tokens[:, 0] = rng.integers(0, lm.text_card, size=frames)
            history = encode_records(tokens)
            if models.cuda:
                torch.cuda.reset_peak_memory_stats(models.device)
            rows = measure_restores(models, history, [floor_s] * frames, sizes, args.restore_busy)
            restore["rows"] = [
                {
                    "frames": r.frames,
                    "replay_ms": r.replay_s * 1000,
                    "chunks": r.chunks,
                    "chunk_median_ms": statistics.median(r.chunk_s[:-1] or [math.nan]) * 1000,
                    "chunk_max_ms": max(r.chunk_s[:-1] or [math.nan]) * 1000,
                    "last_chunk_ms": r.chunk_s[-1] * 1000,
                    "frames_per_s": r.frames_per_s,
                    "stepping_estimate_s": r.stepping_s,
                }
                for r in rows
            ]
            for r in restore["rows"]:
                print(
                    f"[restore] {r['frames']} frames: {r['replay_ms']:.1f} ms in "
                    f"{r['chunks']} chunks",
                    flush=True,
                )
            results.save()
            record = record_bytes(models.lm)  # the tokens and the barge-in's silence
            stage = await measure_stage(
                models, history[: args.stage_history * record], args.stage_busy, args.window_s
            )
            if models.cuda:
                restore["peak_allocated_bytes"] = int(
                    torch.cuda.max_memory_allocated(models.device)
                )
            restore["stage"] = {
                "history_frames": stage.history_frames,
                "busy": stage.busy,
                "restore_s": stage.restore_s,
                "open_s": stage.open_s,
                "chunks": stage.chunks,
                "restored_frames": stage.restored_frames,
                "phases": [
                    {
                        "name": p.name,
                        "ticks": p.ticks,
                        "deadline_misses": p.misses,
                        "step_median_ms": p.median_ms,
                        "step_max_ms": p.max_ms,
                    }
                    for p in stage.phases
                ],
            }
            restore["status"] = "ok"
            phases = restore["stage"]["phases"]
            print(
                f"[restore] stage: {stage.history_frames} frames restored in "
                f"{stage.restore_s:.3f} s beside {stage.busy} busy slots; misses "
                + "/".join(str(p["deadline_misses"]) for p in phases)
                + " (before/during/after)",
                flush=True,
            )
    except Exception as error:
        restore.update(status="oom" if is_oom(error) else "error", error=f"{error!r}"[:800])
        print(f"[restore] {restore['status']}: {restore['error'][:200]}", flush=True)
    finally:
        results.save()
        models.close()


def step_floor(models: Models, frames: int = 12) -> float:
    """A batch of one's step (median): what stepping a frame instead of replaying it costs."""
    import numpy as np

    model = models.model(1)
    model.open_slot(0, {})
    rng = np.random.default_rng(4)
    active = np.ones(1, dtype=bool)
    step_s = []
    for _ in range(frames):
        frame = (0.2 * rng.standard_normal((1, model.frame_samples))).astype(np.float32)
        started = time.perf_counter()
        model.step(frame, active)
        step_s.append(time.perf_counter() - started)
    models.release()
    return statistics.median(step_s[2:])


def model_record(models: Models) -> dict[str, Any]:
    return {
        "model": {
            "shape": models.shape,
            "parameters": models.parameters,
            "lm_kwargs": {k: v for k, v in models.lm_kwargs.items() if k != "delays"},
            "context_frames": models.context,
            "dtype": str(next(models.lm.parameters()).dtype).removeprefix("torch."),
            "mimi_dtype": str(next(models.mimi.parameters()).dtype).removeprefix("torch."),
            "build_s": round(models.build_s, 2),
            "weights_bytes": models.weights_bytes,
            "kv_bytes_per_slot_computed": models.kv_bytes_per_slot(),
            "sampling": dataclasses.asdict(models.sampling),
        }
    }


def run_part(args: argparse.Namespace) -> None:
    results = Results(Path(args.result))
    results.data["part"] = args.part
    results.save()
    runner = run_restore if args.part == "restore" else run_sweep
    asyncio.run(runner(args, results))


# ------------------------------------------------------------------ the parent


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve(args: argparse.Namespace) -> list[str]:
    """Defaults that depend on the device and the model; returns notes for the output."""
    notes = []
    if args.device is None:
        args.device = "cuda" if cuda_available() else "cpu"
    if args.device.startswith("cuda") and not cuda_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device here")
    gpu = args.device.startswith("cuda")
    if not gpu and not args.tiny:
        raise SystemExit(
            "the Moshi-7B shape needs a GPU (15 GB of weights plus 1.6 GB a slot): "
            "on a CPU run --tiny"
        )
    if not gpu:
        asked = f" (--cuda-graphs {args.cuda_graphs} asked)" if args.cuda_graphs else ""
        notes.append(f"CUDA graphs need CUDA: off on CPU{asked}")
        args.cuda_graphs = "off"
    if args.cuda_graphs is None:
        args.cuda_graphs = "both"
    args.levels = args.levels or (TINY_LEVELS if args.tiny else GPU_LEVELS)
    args.steps = args.steps or (60 if args.tiny else 100)
    if args.stage_busy is None:
        args.stage_busy = 4 if args.tiny and not gpu else 32
    if args.stage_history is None:
        args.stage_history = 1000 if args.tiny else 3000
    if args.budget_s is None:
        args.budget_s = 420.0 if gpu and not args.tiny else 0.0
    return notes


def part_command(args: argparse.Namespace, part: str, mode: str, result: Path, budget: float):
    keep = [
        ("--device", args.device),
        ("--levels", args.levels),
        ("--steps", args.steps),
        ("--chunk", args.chunk),
        ("--restore-frames", args.restore_frames),
        ("--restore-busy", args.restore_busy),
        ("--stage-busy", args.stage_busy),
        ("--stage-history", args.stage_history),
        ("--window-s", args.window_s),
        ("--seed", args.seed),
        ("--threads", args.threads),
        ("--context", args.context),
    ]
    command = [sys.executable, "-m", "bench.gpu_native", "--part", part, "--mode", mode]
    command += ["--result", str(result), "--part-budget-s", f"{budget:g}"]
    for flag, value in keep:
        if value is not None:
            command += [flag, str(value)]
    if args.tiny:
        command.append("--tiny")
    return command


def spawn(command: list[str], timeout: float | None, log: list[str]) -> int:
    """The part's process, its output echoed and its last lines kept; killed past
    `timeout`, or when this process is stopped (SIGTERM: `timeout` around the program),
    its results file keeping what it measured. It stays in this process group, so a
    `timeout` around the program ends it too."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if "--mode" in command and command[command.index("--mode") + 1] == "on":
        env.pop("NO_CUDA_GRAPH", None)
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            print(line, end="", flush=True)
            log.append(line.rstrip("\n"))
            del log[:-60]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.append(f"[killed after {timeout:.0f} s]")
        process.kill()
        code = process.wait()
    except BaseException:
        log.append("[killed: the program was stopped]")
        process.kill()
        process.wait()
        raise
    finally:
        reader.join(timeout=5)
    return code


def run_parts(args: argparse.Namespace, notes: list[str], out: Path) -> dict[str, Any]:
    modes = ["on", "off"] if args.cuda_graphs == "both" else [args.cuda_graphs]
    budget = args.budget_s
    restore_budget = min(RESTORE_BUDGET_S, budget / 3) if budget else 0.0
    sweep_budget = (budget - restore_budget) / len(modes) if budget else 0.0
    report: dict[str, Any] = {
        "program": "bench/gpu_native.py",
        "measured_at": now_utc(),
        "command": command_line(args, out),
        "frame_ms": FRAME_MS,
        "cuda_graphs": {"asked": args.cuda_graphs, "modes": modes},
        "steps_per_level": args.steps,
        "budget_s": budget,
        "notes": list(notes),
        "levels": [],
        "parts": [],
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-native-") as scratch:
        plan = [(f"sweep:{mode}", mode, sweep_budget) for mode in modes]
        plan.append(("restore", "off", restore_budget))
        for index, (part, mode, share) in enumerate(plan):
            if part == "restore":  # graphs as production runs them, if they worked
                on_ok = any(
                    row["mode"] == "on" and row.get("status") == "ok" for row in report["levels"]
                )
                mode = "on" if on_ok else "off"
                if "on" in modes and not on_ok:
                    report["notes"].append("the restore ran without CUDA graphs: none worked")
            if budget:  # what is left, shared in proportion to the parts still to run
                left = budget - (time.monotonic() - started)
                later = sum(s for _, _, s in plan[index:])
                share = max(left * share / later, MIN_PART_S)
            result = Path(scratch) / f"{part.replace(':', '-')}.json"
            command = part_command(args, part, mode, result, share)
            log: list[str] = []
            part_started = time.monotonic()
            code: int | None = None
            try:
                code = spawn(command, share + PART_GRACE_S if budget else None, log)
            finally:  # stopped or not, what the part measured is kept
                data = json.loads(result.read_text()) if result.exists() else {}
                merge(report, part, mode, code, data, log)
                report["parts"][-1].update(
                    seconds=round(time.monotonic() - part_started, 1), budget_s=round(share, 1)
                )
                write_outputs(report, out)
    return report


def merge(
    report: dict[str, Any],
    part: str,
    mode: str,
    code: int | None,
    data: dict[str, Any],
    log: list[str],
) -> None:
    """A part's results into the report; `code` None: the program was stopped meanwhile."""
    report["parts"].append(
        {"part": part, "mode": mode, "returncode": code, "log_tail": log[-25:] if code != 0 else []}
    )
    for key in ("model", "device"):
        if key in data and key not in report:
            report[key] = data[key]
    died = "the program was stopped" if code is None else f"the part exited {code}"
    for row in data.get("levels", []):
        if row.get("status") == "running":  # the part ended in this level
            row.update(status="crashed", error=f"{died}: see parts")
        report["levels"].append(row)
    report["notes"] += [f"{part}: {note}" for note in data.get("notes", [])]
    if part == "restore":
        restore = data.get("restore", {"status": "error", "mode": mode})
        if restore.get("status") == "running":
            restore.update(status="crashed", error=f"{died}: see parts")
        report["restore"] = restore


def command_line(args: argparse.Namespace, out: Path) -> str:
    argv, where = list(sys.argv[1:]), os.environ.get("OUT")
    if where:  # the device machine's output folder, as its scripts name it
        argv = ["$OUT" if a in (where, str(out)) and out == Path(where) else a for a in argv]
        if "--out" not in argv:
            argv += ["--out", "$OUT"]
    shown = " ".join(shlex.quote(a) if a != "$OUT" else a for a in argv)
    python = ".venv-moshi/bin/python" if not args.device.startswith("cuda") else "python3"
    return f"{python} -m bench.gpu_native {shown}".strip()


# ------------------------------------------------------------------ output


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f} MiB"


def size(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value >= 2**30:
        return gib(value)
    return mib(value) if value >= 2**20 else f"{value / 2**10:,.0f} KiB"


def ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def render(report: dict[str, Any]) -> str:
    model = report.get("model", {})
    device = report.get("device", {})
    gpu = device.get("gpu")
    tiny = model.get("shape") == "tiny"
    lines = [f"Measured {report['measured_at']}: `{report['command']}`.", ""]
    if not gpu or tiny:
        where = gpu or "CPU"
        lines += [
            f"**{where}, tiny checkpoint: not the H200 figure this program exists for** "
            "(the whole path runs, the numbers say nothing of a 7B model on a GPU).",
            "",
        ]
    host = device.get("host", "?")
    if gpu:
        lines.append(
            f"Machine: {gpu} ({gib(device.get('gpu_memory_bytes'))}, "
            f"{device.get('multiprocessors')} SMs), CUDA {device.get('cuda')}; host {host}; "
            f"torch {device.get('torch')}, moshi {device.get('moshi')}."
        )
    else:
        lines.append(f"Machine: {host}; torch {device.get('torch')}, moshi {device.get('moshi')}.")
    kwargs = model.get("lm_kwargs", {})
    if model:
        shape = (
            "the tiny random checkpoint of harness/tiny_moshi.py"
            if tiny
            else "Moshi-7B's shape (moshiko's published config, random weights built on the GPU)"
        )
        parameters = model.get("parameters", 0)
        count = f"{parameters / 1e9:.2f} B" if parameters >= 1e8 else f"{parameters:,}"
        depth = kwargs.get("depformer_num_layers")
        lines += [
            "",
            f"Model: {shape}: {count} parameters, {kwargs.get('num_layers')} layers of dim "
            f"{kwargs.get('dim')}, a depformer of {depth} layer{'s' if depth != 1 else ''} "
            f"over {kwargs.get('dep_q')} codebooks, context {model.get('context_frames')} "
            f"frames; LM in {model.get('dtype')}, Mimi in {model.get('mimi_dtype')}; built "
            f"in {model.get('build_s')} s. Weights on the device: "
            f"{gib(model.get('weights_bytes'))}; key/value cache per slot from the config: "
            f"{size(model.get('kv_bytes_per_slot_computed'))}.",
        ]
    lines += [
        "",
        f"Each level: N sessions on a `TickBatchedStagePort` on the real clock "
        f"({report['frame_ms']:g} ms frames), each fed speech one frame at a time, "
        f"{report['steps_per_level']} frames measured after 12 warm-up ticks; the step is "
        "`MoshiFrameModel.step` for all slots (Mimi encode, LM, depformer, Mimi decode). "
        "*Per slot*: the level's peak allocated memory less what was allocated before it "
        "(the weights), over N (on CPU the process's resident memory, and no figure per "
        "slot). CUDA graphs *on* is moshi's own wrapping (what `moshi.server` runs), "
        "*off* the same inside `no_cuda_graph()`.",
        "",
        "| CUDA graphs | sessions | status | step median / p99 / max | median / frame "
        "| ticks | deadline misses | silence | input cut | memory peak | per slot |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(report.get("levels", []), key=lambda r: (r["mode"], r["sessions"])):
        if row.get("status") != "ok" and "step_ms" not in row:
            lines.append(
                f"| {row['mode']} | {row['sessions']} | {row.get('status')}: "
                f"{str(row.get('error', ''))[:120]} | | | | | | | | |"
            )
            continue
        step, memory = row["step_ms"], row.get("memory", {})
        peak = memory.get("peak_allocated_bytes", memory.get("peak_rss_bytes"))
        peak_text = gib(peak) + (" (RSS)" if memory.get("kind") == "rss" else "")
        lines.append(
            f"| {row['mode']} | {row['sessions']} | {row['status']} "
            f"| {ms(step['median'])} / {ms(step['p99'])} / {ms(step['max'])} ms "
            f"| {row['frame_share']:.3f} | {row['ticks']} | {row['deadline_misses']} "
            f"| {row['silence_frames']} | {row['input_frames_cut']} | {peak_text} "
            f"| {mib(memory.get('per_slot_bytes'))} |"
        )
    restore = report.get("restore") or {}
    lines += ["", *render_restore(restore)]
    notes = report.get("notes", [])
    failed = [p for p in report.get("parts", []) if p["returncode"] != 0]
    if notes or failed:
        lines.append("")
        lines += [f"- {note}" for note in notes]
        lines += [
            f"- part {p['part']} "
            + (f"exited {p['returncode']}" if p["returncode"] is not None else "was stopped")
            + ": "
            + (p["log_tail"][-1] if p["log_tail"] else "")
            for p in failed
        ]
    return "\n".join(lines)


def render_restore(restore: dict[str, Any]) -> list[str]:
    if not restore:
        return ["Restore: not run."]
    lines = [
        f"**Restore** (CUDA graphs {restore.get('mode')}; replay chunks of "
        f"{restore.get('chunk_frames')} frames, the most a `replay_work` call may take): "
        "`restore_slot` + every `replay_work` into "
        f"one slot while {restore.get('busy')} others are busy and stepped between chunks "
        "(their steps excluded); the history is random valid tokens. *Stepping instead* is "
        "the frames times one step of a batch of one "
        f"({ms(restore.get('step_floor_ms'))} ms), an estimate.",
        "",
    ]
    if restore.get("status") not in ("ok", "running") or "rows" not in restore:
        return [*lines, f"Status: {restore.get('status')}: {restore.get('error', '')}"]
    lines += [
        "| frames restored | conversation | replay | chunks | chunk median / max "
        "| last chunk | frames/s | stepping instead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in restore["rows"]:
        lines.append(
            f"| {r['frames']} | {r['frames'] * FRAME_MS / 1000:.0f} s "
            f"| {r['replay_ms']:.1f} ms | {r['chunks']} "
            f"| {ms(r['chunk_median_ms'])} / {ms(r['chunk_max_ms'])} ms "
            f"| {ms(r['last_chunk_ms'])} ms | {r['frames_per_s']:,.0f} "
            f"| {r['stepping_estimate_s']:.2f} s |"
        )
    stage = restore.get("stage")
    if not stage:
        return [*lines, "", f"Stage: {restore.get('status')}: {restore.get('error', '')}"]
    lines += [
        "",
        f"**Deadline misses while one restores**: {stage['busy']} sessions on the real "
        f"stage, then one more restored from a {stage['history_frames']}-frame history "
        f"(`keep_history` + `submit_initial`): restored in {stage['restore_s'] * 1000:.0f} ms "
        f"({stage['chunks']} `replay_work` calls, run after a tick's step while the next "
        "frame is not due, each as many frames as the stage finds time for, at most "
        f"{restore.get('chunk_frames')}).",
        "",
        "| phase | ticks | deadline misses | step median / max |",
        "|---|---|---|---|",
    ]
    for p in stage["phases"]:
        lines.append(
            f"| {p['name']} | {p['ticks']} | {p['deadline_misses']} "
            f"| {ms(p['step_median_ms'])} / {ms(p['step_max_ms'])} ms |"
        )
    return lines


def plot(report: dict[str, Any], path: Path) -> str | None:
    """Step time and deadline misses against sessions; None, or why there is no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"no plot: matplotlib is not importable here ({error})"
    rows = [r for r in report.get("levels", []) if "step_ms" in r]
    if not rows:
        return "no plot: no level was measured"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for mode in sorted({r["mode"] for r in rows}):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["sessions"])
        x = [r["sessions"] for r in mine]
        label = f"CUDA graphs {mode}"
        top.plot(x, [r["step_ms"]["median"] for r in mine], marker="o", label=f"{label}: median")
        top.plot(
            x,
            [r["step_ms"]["p99"] for r in mine],
            linestyle="--",
            marker=".",
            label=f"{label}: p99",
        )
        bottom.plot(
            x,
            [100 * r["deadline_misses"] / max(r["ticks"], 1) for r in mine],
            marker="o",
            label=label,
        )
    top.axhline(report["frame_ms"], color="red", linewidth=1, label="the 80 ms frame")
    top.set_ylabel("batched step, ms")
    shape = report.get("model", {}).get("shape", "?")
    shape = "tiny checkpoint" if shape == "tiny" else "Moshi-7B shape"
    where = report.get("device", {}).get("gpu") or "CPU"
    top.set_title(f"{shape} on {where}: batched step and deadline misses against sessions")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    top.set_ylim(bottom=0)
    bottom.set_ylim(bottom=0, top=max(5.0, bottom.get_ylim()[1]))
    levels = sorted({r["sessions"] for r in rows})
    bottom.set_xticks(levels)
    bottom.set_ylabel("deadline misses, % of ticks")
    bottom.set_xlabel("sessions (slots stepped together)")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_outputs(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    why = plot(report, out / "gpu_native.png")
    report["plot"] = "gpu_native.png" if why is None else None
    if why:
        report["plot_note"] = why
    (out / "gpu_native.json").write_text(json.dumps(clean(report), indent=1))
    (out / "gpu_native.md").write_text(render(report) + "\n")


def write_docs(report: dict[str, Any], args: argparse.Namespace) -> None:
    from bench.common import write_section

    docs = args.docs or DOCS
    body = render(report)
    if report.get("plot") is not None:
        (docs / "img").mkdir(parents=True, exist_ok=True)
        plot(report, docs / "img" / f"{args.section}.png")
        body += f"\n\n![step time and deadline misses against sessions](img/{args.section}.png)"
    write_section(
        "benchmarks.md",
        args.section,
        body,
        "Sessions per GPU for the Moshi family (`bench/gpu_native.py`)"
        + (f", {args.label}" if args.label else ""),
        docs=docs,
    )


def default_out() -> Path:
    return Path(os.environ.get("OUT") or ROOT / "test-artifacts" / "gpu_native")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default=None, help="cuda, cuda:N or cpu (default: cuda when torch sees one)"
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="harness/tiny_moshi.py's tiny random checkpoint instead of the 7B shape (CPU runs)",
    )
    parser.add_argument(
        "--levels",
        default=None,
        help=f"sessions per level, comma-separated; 'max' adds levels while the GPU's memory "
        f"holds them (default {GPU_LEVELS}; --tiny: {TINY_LEVELS})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="frames of real time measured per level (default 100, 8 s; --tiny: 60)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        help="the LM's context in frames (default: the model's, 3000 for Moshi-7B: about "
        "1.6 GB of key/value cache a slot; shorter lets more slots fit)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default $OUT, else test-artifacts/)"
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=("on", "off", "both"),
        default=None,
        help="moshi's CUDA graphs (default both on CUDA; always off on CPU)",
    )
    parser.add_argument(
        "--restore-frames",
        default="250,1000,3000",
        help="history sizes restored, comma-separated (default 250,1000,3000)",
    )
    parser.add_argument(
        "--restore-busy", type=int, default=8, help="busy slots beside the timed restores (8)"
    )
    parser.add_argument(
        "--stage-busy",
        type=int,
        default=None,
        help="busy sessions on the stage while one restores (default 32; --tiny on CPU: 4)",
    )
    parser.add_argument(
        "--stage-history",
        type=int,
        default=None,
        help="frames restored on the stage (default 3000; --tiny: 1000)",
    )
    parser.add_argument(
        "--window-s",
        type=float,
        default=2.0,
        help="the stage's window before and after that restore, seconds (default 2)",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=64,
        help="the most frames one replay_work call replays (the model's replay_chunk_frames; "
        "the restore rows ask for this many a call), frames (64)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds for the whole run, shared by its parts (default 420 on a GPU; "
        "0: none, the --tiny default)",
    )
    parser.add_argument("--seed", type=int, default=1234, help="the random weights' seed")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="also write the section of docs/benchmarks.md and docs/img/<section>.png",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="render an earlier run's gpu_native.json (with --write-docs: into docs/) "
        "instead of measuring",
    )
    add_output_arguments(parser, "gpu_native")
    # a part run by the parent, in a process of its own
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="off", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part-budget-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.part:
        run_part(args)
        return
    out = args.out or default_out()
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        write_outputs(report, out)
    else:
        notes = resolve(args)
        # stopped from outside (`timeout`): the part in flight is killed, and what was
        # measured is written before the program exits
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        report = run_parts(args, notes, out)
    print(render(report), flush=True)
    print(f"\nwritten to {out}: " + ", ".join(OUT_FILES), flush=True)
    if args.write_docs:
        write_docs(report, args)
    broken = [p["part"] for p in report.get("parts", []) if p["returncode"] != 0]
    if broken:
        print(f"parts that failed: {', '.join(broken)} (their errors are in the JSON)")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
