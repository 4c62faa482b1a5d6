"""Nemotron VoiceChat's step cost as the conversation grows: ours flat, NeMo's recompute not.

NeMo's own inference of Nemotron VoiceChat (nemo-toolkit 3.0.0,
`DuplexSTTStreamingInference._step_inference`) runs Nemotron-H with no LLM cache ("full
history each step"), so position t costs a forward over t + 1 positions. Our streaming
step (plugins/nemotron: `StreamingVoiceChat` behind `NemotronFrameModel`) carries every
state per slot, so a frame costs one position whatever the conversation's length, save
Nemotron-H's attention layers and the speech decoder's backbone, which attend to what came
before. Measured on the tiny random checkpoint of harness/tiny_nemotron.py (built in a
temporary folder, nothing downloaded), on CPU, greedy:

1. Our step. `NemotronFrameModel.step` (its public API: perception, LLM, speech decoder,
   codec) for 1 slot and for 4 slots in one batch, every slot fed its own gated tone over
   noise (16 kHz, 1280-sample frames, 16-bit samples as a client's pcm16): the wall time of
   each step in a window early on (frames 2 to 2 + `--window`) of a fresh conversation and
   in one around frame `--frames` (1000) of a conversation stepped there, each on a model
   of its own, the two windows' steps interleaved one by one (the machine's load drifts;
   so it touches both alike). Also, in the same steps, the LLM's share:
   `NemotronHStep.step`, the part that replaces NeMo's recompute.
2. The baseline, in the same run on the same model: NeMo's `_step_inference(t)` driven as
   `offline_inference` drives it (`_init_inference` over the whole recording, `_step_zero`,
   then every t in turn), one loop run untimed to the late window, then its steps
   interleaved with a fresh loop's early window; batch 1 and batch 4. It is the LLM only
   (NeMo's speech decoder steps with a cache, as ours).
3. Per-slot state at frame 10 and at frame `--frames`: the LLM's (`NemotronHStep.export`:
   Mamba-2 convolution tails and SSM states, attention keys and values), the speech
   decoder's (its backbone cache, codes window) and the perception's; the history record
   (`state_record_bytes`) per frame, per minute, per hour.
4. Restore: `restore_slot` + `replay_work` until done, of the 1-slot run's first N
   records into a fresh slot (after a small warm-up restore), per frame of history.

The figures of merit are ratios (frame 1000 over frame 10; NeMo's step over ours): the
absolute times of a 64-wide model on a shared 2-core CPU say nothing of the 11B model on a
GPU. Needs torch and nemo-toolkit: run with `.venv-nemotron/bin/python -m
bench.nemotron_step`. Writes the `nemotron_step` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    add_output_arguments,
    commit,
    dirty,
    machine,
    now_utc,
    percentile,
    write_section,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FRAME_SAMPLES = 1280
FRAME_MS = 80.0
#: the first frame of the early window: frames 0 and 1 are a slot's start (the encoder's
#: first chunks, the speech decoder's warm-up), not its steady state
EARLY_START = 2
#: the frame at which the early per-slot state is read
EARLY_STATE_FRAME = 10
#: frames of a throwaway conversation stepped before the measured one (warm kernels)
WARM_FRAMES = 30
#: frames of the small restore run (untimed) before the measured ones
WARM_RESTORE_FRAMES = 8


def user_audio(seed: int, frames: int) -> np.ndarray:
    """`frames` 80 ms frames of 16 kHz audio [frames, 1280]: a tone gated at 0.7 Hz over
    noise, different per seed, quantized to 16 bits (the tests' input, tests/plugins/nemotron)."""
    rng = np.random.default_rng(seed)
    t = np.arange(frames * FRAME_SAMPLES) / 16000
    tone = 0.3 * np.sin(2 * np.pi * (220 + 40 * seed) * t) * (np.sin(2 * np.pi * 0.7 * t) > 0)
    audio = tone + 0.1 * rng.standard_normal(t.shape)
    audio = np.round(audio * 32768) / 32768
    return audio.astype(np.float32).reshape(frames, FRAME_SAMPLES)


@dataclasses.dataclass
class Window:
    """The step times of one window of frames."""

    first: int
    last: int  # inclusive
    step_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_s) * 1000 if self.step_s else float("nan")

    @property
    def p90_ms(self) -> float:
        return percentile(sorted(self.step_s), 0.90) * 1000 if self.step_s else float("nan")

    def __contains__(self, frame: int) -> bool:
        return self.first <= frame <= self.last


@dataclasses.dataclass
class Run:
    """One measured loop: a label, a batch, its early and late windows."""

    label: str
    batch: int
    early: Window
    late: Window

    @property
    def ratio(self) -> float:
        return self.late.median_ms / self.early.median_ms


@dataclasses.dataclass
class StateBytes:
    llm_fixed: int
    llm_kv: int
    speech: int
    perception: int

    @property
    def total(self) -> int:
        return self.llm_fixed + self.llm_kv + self.speech + self.perception


@dataclasses.dataclass
class Restore:
    frames: int
    replay_s: float
    calls: int
    stepping_s: float


def windows(frames: int, window: int) -> tuple[Window, Window]:
    early = Window(EARLY_START, EARLY_START + window - 1)
    late = Window(frames - window // 2, frames - window // 2 + window - 1)
    if late.first <= early.last:
        raise SystemExit(f"--frames {frames} is too small for two windows of {window}")
    return early, late


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in `obj` (tensors, containers, dataclasses, HF caches)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple | deque):
        return sum(tensor_bytes(item) for item in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(item) for item in obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    layers = getattr(obj, "layers", None)  # a transformers Cache
    if isinstance(layers, list):
        return sum(
            tensor_bytes(getattr(layer, "keys", None))
            + tensor_bytes(getattr(layer, "values", None))
            for layer in layers
        )
    return 0


def slot_state(model: Any, slot: int) -> StateBytes:
    """The slot's streaming state: the LLM's (`NemotronHStep.export`), the speech
    decoder's (the slot's `SlotTokens`: backbone cache, codes window) and the perception's
    (encoder caches, raw-audio tail, mel cache)."""
    engine = model.engine
    llm = engine.llm.export(slot)
    kv = sum(tensor_bytes(v) for k, v in llm.items() if k[0] in "kv")
    fixed = sum(tensor_bytes(v) for k, v in llm.items() if k[0] not in "kv")
    perception = engine.perception
    rows = [
        getattr(perception, name)[:, slot]
        for name in ("cache_channel", "cache_time")
        if hasattr(perception, name)
    ] + [getattr(perception, name)[slot] for name in ("raw", "mel") if hasattr(perception, name)]
    return StateBytes(fixed, kv, tensor_bytes(engine.state[slot]), tensor_bytes(rows))


class Timed:
    """Wraps a callable, keeping the wall time of every call (the LLM's share of a step)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.spent: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.spent.append(time.perf_counter() - started)


class Conversation:
    """`slots` slots of one `NemotronFrameModel`, all open, stepped together on their own
    audio; every step's wall time and the LLM's share of it, slot 0's records."""

    def __init__(self, checkpoint: Path, slots: int, total: int, threads: int) -> None:
        from plugins.nemotron.frame_model import NemotronFrameModel

        self.model = NemotronFrameModel.load(str(checkpoint), slots, "cpu", threads)
        self.active = np.ones(slots, dtype=bool)
        # a throwaway conversation first: the measured one's early frames then run on warm
        # kernels and allocator, as a worker's do once it has served anything
        self._open()
        warm = np.stack([user_audio(100 + slot, WARM_FRAMES) for slot in range(slots)], axis=1)
        for frame in range(WARM_FRAMES):
            self.model.step(warm[frame], self.active)
        self._close()
        self._open()
        self.audio = np.stack([user_audio(1 + slot, total) for slot in range(slots)], axis=1)
        self.frame = 0
        self.step_s: list[float] = []
        self.records = bytearray()
        self.llm = Timed(self.model.engine.llm.step)
        self.model.engine.llm.step = self.llm  # the instance's attribute, the class untouched

    def _open(self) -> None:
        for slot in range(self.model.slots):
            self.model.open_slot(slot, {})

    def _close(self) -> None:
        for slot in range(self.model.slots):
            self.model.close_slot(slot)

    def step(self) -> tuple[float, float]:
        """The next frame for every slot: its wall time and the LLM step's."""
        started = time.perf_counter()
        outputs = self.model.step(self.audio[self.frame], self.active)
        self.step_s.append(time.perf_counter() - started)
        self.records += outputs[0].record
        self.frame += 1
        return self.step_s[-1], self.llm.spent[-1]

    def finish(self) -> Any:
        """Every slot closed, the model as it was loaded (for the baseline, the restores)."""
        del self.model.engine.llm.step
        self._close()
        return self.model


def interleave(early: Callable[[], Any], late: Callable[[], Any], steps: int) -> None:
    """`steps` calls of each, alternating (and alternating which goes first), so a drift in
    the machine's load touches both windows alike."""
    for i in range(steps):
        for call in (early, late) if i % 2 == 0 else (late, early):
            call()


def run_ours(
    checkpoint: Path, slots: int, frames: int, window: int, threads: int
) -> tuple[Run, Run, list[float], bytes, dict[int, StateBytes], Any, Any]:
    """Two conversations of `slots` slots each on a model of its own: one stepped to the
    late window, then its window interleaved step by step with a fresh one's early window.
    The whole step's windows, the LLM step's, the long one's every step time, its slot 0's
    records and state at two frames, and both models (for the baseline and the restores)."""
    early, late = windows(frames, window)
    llm_early, llm_late = windows(frames, window)
    long = Conversation(checkpoint, slots, late.last + 1, threads)
    fresh = Conversation(checkpoint, slots, early.last + 1, threads)
    states: dict[int, StateBytes] = {}
    while long.frame < late.first:
        long.step()
        if long.frame in (EARLY_STATE_FRAME, frames):
            states[long.frame] = slot_state(long.model, 0)
    while fresh.frame < early.first:
        fresh.step()

    def measure(conversation: Conversation, whole: Window, llm: Window) -> Callable[[], None]:
        def one() -> None:
            spent, llm_spent = conversation.step()
            whole.step_s.append(spent)
            llm.step_s.append(llm_spent)
            if conversation.frame in (EARLY_STATE_FRAME, frames):
                states[conversation.frame] = slot_state(conversation.model, 0)

        return one

    interleave(measure(fresh, early, llm_early), measure(long, late, llm_late), window)
    whole_run = Run("ours: `NemotronFrameModel.step` (the whole frame)", slots, early, late)
    llm_run = Run("ours: of which the LLM (`NemotronHStep.step`)", slots, llm_early, llm_late)
    return (
        whole_run,
        llm_run,
        long.step_s,
        bytes(long.records),
        states,
        long.finish(),
        fresh.finish(),
    )


def run_nemo(voicechat: Any, batch: int, frames: int, window: int) -> Run:
    """NeMo 3.0.0's duplex loop as `offline_inference` runs it (t is the frame: position t is
    frame t without a prompt): one loop run untimed to the late window, then its
    `_step_inference(t)` interleaved step by step with a fresh loop's early window."""
    import torch

    early, late = windows(frames, window)
    total = late.last + 1
    audio = torch.from_numpy(
        np.stack([user_audio(1 + row, total).reshape(-1) for row in range(batch)])
    )
    lengths = torch.full((batch,), audio.shape[1], dtype=torch.long)
    inference = voicechat.stt_model.streaming_inference

    def start() -> dict[str, Any]:
        state = inference._init_inference(audio, lengths, 0, None, None)
        if state["use_cache"]:
            raise SystemExit("NeMo's loop runs this LLM with a cache: not the baseline wanted")
        if state["T"] < total:
            raise SystemExit(f"NeMo encoded {state['T']} positions, fewer than {total}")
        state["answer"], state = inference._step_zero(state)
        state["t"] = 1
        return state

    def step(state: dict[str, Any]) -> float:
        started = time.perf_counter()
        state["answer"] = inference._step_inference(state["t"], state, state["answer"])
        state["t"] += 1
        return time.perf_counter() - started

    with torch.no_grad():
        long, fresh = start(), start()
        while long["t"] < late.first:
            step(long)
        while fresh["t"] < early.first:
            step(fresh)
        interleave(
            lambda: early.step_s.append(step(fresh)),
            lambda: late.step_s.append(step(long)),
            window,
        )
    return Run(
        "NeMo 3.0.0: `_step_inference(t)` (the LLM over t + 1 positions)", batch, early, late
    )


def measure_restores(
    model: Any, records: bytes, step_s: list[float], sizes: list[int]
) -> list[Restore]:
    """Each size's first records restored into slot 0 of the (closed) 1-slot model."""
    record = model.state_record_bytes

    def restore(frames: int) -> tuple[float, int]:
        started = time.perf_counter()
        model.restore_slot(0, {}, records[: frames * record])
        calls = 0
        while model.replay_pending(0):
            model.replay_work(0, model.replay_chunk_frames)
            calls += 1
        spent = time.perf_counter() - started
        model.close_slot(0)
        return spent, calls

    restore(WARM_RESTORE_FRAMES)
    results = []
    for frames in sizes:
        spent, calls = restore(frames)
        results.append(Restore(frames, spent, calls, sum(step_s[:frames])))
    return results


def step_table(runs: list[Run]) -> list[str]:
    early, late = runs[0].early, runs[0].late
    rows = [
        f"| step | batch | frames {early.first}-{early.last}: median / p90 "
        f"| frames {late.first}-{late.last}: median / p90 | per slot at {late.first}-{late.last} "
        "| late / early |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        rows.append(
            f"| {run.label} | {run.batch} | {run.early.median_ms:.2f} / {run.early.p90_ms:.2f} ms "
            f"| {run.late.median_ms:.2f} / {run.late.p90_ms:.2f} ms "
            f"| {run.late.median_ms / run.batch:.2f} ms | **{run.ratio:.2f}x** |"
        )
    return rows


def kib(size: float) -> str:
    return f"{size / 1024:,.1f} KiB"


def state_table(states: dict[int, StateBytes]) -> list[str]:
    (f0, early), (f1, late) = sorted(states.items())
    per = (late.llm_kv - early.llm_kv) / (f1 - f0)
    rows = [
        f"| per slot | at frame {f0} | at frame {f1} | grows by |",
        "|---|---|---|---|",
        f"| LLM: Mamba-2 conv tails + SSM states | {kib(early.llm_fixed)} | "
        f"{kib(late.llm_fixed)} | nothing |",
        f"| LLM: attention keys + values | {kib(early.llm_kv)} | {kib(late.llm_kv)} "
        f"| {per:,.0f} B a frame |",
        f"| speech decoder: backbone cache, codes window | {kib(early.speech)} "
        f"| {kib(late.speech)} | {(late.speech - early.speech) / (f1 - f0):,.0f} B a frame |",
        f"| perception: encoder caches, audio and mel tails | {kib(early.perception)} "
        f"| {kib(late.perception)} | nothing |",
        f"| **all** | {kib(early.total)} | {kib(late.total)} | "
        f"{(late.total - early.total) / (f1 - f0):,.0f} B a frame |",
    ]
    return rows


def restore_table(results: list[Restore]) -> list[str]:
    rows = [
        "| frames restored | conversation | replay | `replay_work` calls | per frame of history "
        "| stepping the same frames | stepping / replay |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.frames} | {r.frames * FRAME_MS / 1000:.0f} s | {r.replay_s:.2f} s | {r.calls} "
            f"| {r.replay_s / r.frames * 1000:.2f} ms | {r.stepping_s:.2f} s "
            f"| {r.stepping_s / r.replay_s:.1f}x |"
        )
    return rows


def main(args: argparse.Namespace) -> None:
    quick = args.quick
    frames = args.frames or (60 if quick else 1000)
    window = args.window or (8 if quick else 20)
    batches = [int(n) for n in (args.slots or ("1,2" if quick else "1,4")).split(",")]
    sizes = [int(n) for n in (args.restore or ("20,60" if quick else "250,1000")).split(",")]
    if batches[0] != 1:
        raise SystemExit("--slots must start with 1 (its run is the restores' history)")
    if max(sizes) > windows(frames, window)[1].last + 1:
        raise SystemExit("--restore sizes must not pass the frames stepped")

    import torch

    from harness.tiny_nemotron import build_tiny_checkpoint

    load_at_start = os.getloadavg()[0]
    started = time.monotonic()
    ours: list[Run] = []
    llm: list[Run] = []
    nemo: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="tiny-nemotron-") as directory:
        checkpoint = build_tiny_checkpoint(Path(directory))
        history = b""
        history_s: list[float] = []
        states: dict[int, StateBytes] = {}
        restores: list[Restore] = []
        record_bytes = chunk = 0
        params = 0
        sizes_note: dict[str, int] = {}
        for batch in batches:
            whole, part, step_s, records, slot_states, model, other = run_ours(
                checkpoint, batch, frames, window, args.threads
            )
            other.close()
            del other
            ours.append(whole)
            llm.append(part)
            print(
                f"ours, {batch} slot(s): {whole.early.median_ms:.2f} -> "
                f"{whole.late.median_ms:.2f} ms ({whole.ratio:.2f}x); LLM "
                f"{part.early.median_ms:.2f} -> {part.late.median_ms:.2f} ms ({part.ratio:.2f}x)",
                flush=True,
            )
            baseline = run_nemo(model.model, batch, frames, window)
            nemo.append(baseline)
            print(
                f"NeMo, batch {batch}: {baseline.early.median_ms:.2f} -> "
                f"{baseline.late.median_ms:.2f} ms ({baseline.ratio:.2f}x)",
                flush=True,
            )
            if batch == 1:
                history, history_s, states = records, step_s, slot_states
                record_bytes, chunk = model.state_record_bytes, model.replay_chunk_frames
                params = sum(p.numel() for p in model.model.parameters())
                sizes_note = {
                    "llm": sum(p.numel() for p in model.model.stt_model.llm.parameters()),
                    "tts": sum(p.numel() for p in model.model.tts_model.parameters()),
                    "window": model.model.tts_model.tts_model.backbone.config.sliding_window,
                }
                restores = measure_restores(model, history, history_s, sizes)
                for r in restores:
                    print(
                        f"restore {r.frames} frames: {r.replay_s:.2f} s, "
                        f"{r.replay_s / r.frames * 1000:.2f} ms a frame",
                        flush=True,
                    )
            model.close()
            del model
    elapsed = time.monotonic() - started

    command = ".venv-nemotron/bin/python -m bench.nemotron_step" + (" --quick" if quick else "")
    for flag, value in [
        ("--frames", args.frames),
        ("--window", args.window),
        ("--slots", args.slots),
        ("--restore", args.restore),
    ]:
        if value is not None:
            command += f" {flag} {value}"
    if args.threads != 1:
        command += f" --threads {args.threads}"
    changed = dirty(["plugins/nemotron", "harness/tiny_nemotron.py"])
    late = ours[0].late
    rows: list[Run] = []
    for whole, part, baseline in zip(ours, llm, nemo, strict=True):
        rows += [whole, part, baseline]
    comparisons = []
    for whole, part, baseline in zip(ours, llm, nemo, strict=True):
        comparisons.append(
            f"batch {whole.batch}, NeMo's step takes "
            f"{baseline.late.median_ms / part.late.median_ms:.1f}x our LLM step "
            f"({baseline.late.median_ms / whole.late.median_ms:.2f}x our whole frame step)"
        )
    per_minute = record_bytes * 60_000 / FRAME_MS
    llm_share = llm[0].late.median_ms / ours[0].late.median_ms
    body = [
        f"Measured {now_utc()} on {machine()}, commit {commit()}"
        + (f" with uncommitted changes in {changed}" if changed else "")
        + f": `{command}` ({elapsed:.0f} s). Load average (1 min) {load_at_start:.2f} at the "
        f"start, {os.getloadavg()[0]:.2f} at the end.",
        "",
        f"The tiny random Nemotron VoiceChat of `harness/tiny_nemotron.py` ({params:,} "
        "parameters: a 4-layer Nemotron-H of width 64, Mamba-2 / MLP / attention / Mamba-2; "
        "a 2-layer FastConformer; a 1-layer EAR-TTS backbone), CPU, torch "
        f"{torch.__version__}, {args.threads} thread{'s' if args.threads != 1 else ''} "
        "(`threads` as the plugin's option; its default on this 2-core machine is 1), greedy. "
        "Every slot hears its own gated tone over noise (16 kHz, 80 ms frames of 1280 "
        "samples, 16-bit), from its first frame, no prompt.",
        "",
        f"**Step time against the conversation's length.** A window of {window} steps early "
        f"in a fresh conversation (frames {ours[0].early.first}-{ours[0].early.last}; frames "
        f"0 and 1 are a slot's start) and one around frame {frames} of a conversation "
        f"stepped there (frames {late.first}-{late.last}, {late.first * FRAME_MS / 1000:.0f} s "
        "in), each on a model of its own, the two windows' steps interleaved one by one so "
        "that a change in the machine's load touches both alike. *Ours* is "
        "`NemotronFrameModel.step` for every slot in one batch: the perception's streaming "
        "step, Nemotron-H's one-position step, the speech decoder's step and the codec's "
        "incremental decoding; *of which the LLM* is the same steps' `NemotronHStep.step` "
        "alone, the part that replaces NeMo's. *NeMo 3.0.0* is "
        "`DuplexSTTStreamingInference._step_inference(t)` on the same model, driven as "
        "`offline_inference` drives it (`_init_inference` over the whole recording, "
        "`_step_zero`, then every t; the same two windows, interleaved likewise): Nemotron-H "
        "with no cache, "
        "over the t + 1 positions so far, the LLM only (NeMo's speech decoder steps with a "
        "cache, like ours). *Late / early* is the figure of merit.",
        "",
        *step_table(rows),
        "",
        f"At frames {late.first}-{late.last}: " + "; ".join(comparisons) + ".",
        "",
        "Ours grows a little, as it should: the one attention layer of Nemotron-H attends to "
        "the slot's whole history, and the speech decoder's Gemma-3 backbone attends to its "
        f"own (its sliding window: {sizes_note['window']} positions); the Mamba-2 layers, "
        "the MLP, the encoder and the codec cost the same at every frame. NeMo's grows with "
        "t: every position re-runs the whole history through all four layers. On this tiny "
        "model the fixed cost of a forward (Python, small kernels) hides much of that "
        "growth (the larger batch shows more of it); on the 11B model the recompute's work "
        "grows with t at full width, and at frame 1000 NeMo's step is a forward over 1000 "
        "positions for every 80 ms frame. The LLM is a small part of this tiny model "
        f"({sizes_note['llm']:,} of its {params:,} parameters; the speech decoder "
        f"{sizes_note['tts']:,}) and {llm_share:.0%} of our whole step at batch 1, so here "
        "NeMo's LLM step alone can cost less than our whole frame; what counts is that the "
        "one grows with the conversation and the other does not.",
        "",
        f"**Per-slot state**, slot 0 of the 1-slot run (float32). The history record is "
        f"{record_bytes:,} B a frame (`state_record_bytes`: the frame's 16-bit input, its "
        "tokens and its codes): "
        f"{per_minute / 1e6:.2f} MB a minute of conversation, {per_minute * 60 / 1e6:.0f} MB "
        "an hour; what the worker appends to Redis for a session.",
        "",
        *state_table(states),
        "",
        f"**Restore.** The 1-slot run's first N records restored into a fresh slot "
        f"(`restore_slot` + `replay_work` until done, {chunk} frames a call; after an "
        f"untimed {WARM_RESTORE_FRAMES}-frame restore): the first two frames one by one, "
        "then each call's frames in one forward of each part (perception over their "
        "audio, the LLM over their positions, the speech decoder fed the records' codes; "
        "no codec decoding, nothing sampled). *Stepping the same frames* is what the live "
        "steps of those frames took.",
        "",
        *restore_table(restores),
        "",
        "**What only a GPU can show**: the published model (about 11B parameters, "
        "Nemotron-H hybrid LLM, FastConformer, EAR-TTS, codec) stepped per slot count "
        "within the 80 ms frame, ours against NeMo's recompute at the same conversation "
        "length, and the GPU memory per slot. Not measured here.",
    ]
    text = "\n".join(body)
    print(text)
    write_section(
        "benchmarks.md",
        args.section,
        text,
        "Nemotron VoiceChat: step time as the conversation grows, against NeMo's recompute "
        "(`bench/nemotron_step.py`)" + (f", {args.label}" if args.label else ""),
        docs=args.docs,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--frames",
        type=int,
        default=None,
        help="the late window's centre, frames (default 1000; --quick: 60)",
    )
    parser.add_argument(
        "--window", type=int, default=None, help="steps timed per window (default 20; --quick: 8)"
    )
    parser.add_argument(
        "--slots",
        default=None,
        help="batches, comma-separated, the first 1 (default 1,4; --quick: 1,2)",
    )
    parser.add_argument(
        "--restore",
        default=None,
        help="history sizes restored, comma-separated (default 250,1000; --quick: 20,60)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the plugin's default on a 2-core machine)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    add_output_arguments(parser, "nemotron_step")
    with contextlib.suppress(KeyboardInterrupt):
        main(parser.parse_args())
