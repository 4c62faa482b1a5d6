"""MiniCPM-o 4.5's unit step against slots, its record bytes, and its restore pace.

Measured on the tiny random checkpoint of plugins/minicpmo/builder.py (built in a temporary
folder, nothing downloaded), on CPU, greedy (text and speech codes argmax), the tone
vocoder, through `MiniCPMOFrameModel` as the worker's plugin builds it
(`MiniCPMOPlugin.frame_model`, the model the tick stage steps once a second):

1. **Unit step against slots.** 1, 2, 4 and 8 active slots of one model (built for the most
   slots, as a worker is for its `--max-sessions`), each slot its own conversation: user
   turns of voiced syllables over breath noise, ending mid-unit, then pauses of room tone
   (16 kHz, exactly pcm16). Two series: audio only, and with a camera frame every unit for
   half the slots (slot 0, 2, ...: 640x480 JPEGs of a seeded moving scene). Each slot's
   first two units are not timed (the mel's and the encoder's start), then `--units`
   units are: p50/p95 wall time of `step`, and against the unit's 1 s of real time. The
   unit split by part, from wrappers the bench sets on the engine's objects (instance
   attributes; the classes untouched): JPEG decode, mel (per slot), the audio encoder,
   the vision tower, the language model's prefill, the decision steps (their forwards,
   sampling and bookkeeping), the speech-token model, the vocoder (per slot) and the rest
   (checks, quantising, records).
2. **The floor**, measured in the same run on the same machine: the language model's
   forwards of one unit as transformers runs them (a bare `Qwen3ForCausalLM` of the tiny
   model's config with its own `DynamicCache`): batch = the slots, the cache filled to the
   slots' mean memory length, one forward of the unit's prefill positions (the longest
   row), then as many one-position forwards as the unit took decision steps. It is the
   one part no implementation of the duplex loop can skip; the step over it says what the
   rest (audio, vision, speech, vocoder, our bookkeeping) costs on top, and our own
   language-model forwards over it what our per-slot memory costs against transformers'.
3. **Record bytes.** The real records (`FrameOutput.record`) of a `--record-units`
   conversation (default 60 units, a minute), listening and speaking units apart, without
   and with a camera frame each unit (the same audio): bytes a unit, a minute and an hour,
   with the 4-byte length each takes in the history key (the sized layout).
4. **Restore against history.** A conversation stepped alone to the longest history (+ a
   few units), its records; then `restore_slot` + `replay_work` in chunks of
   `replay_chunk_frames` for each history length (default 30 s, 2 min, 5 min, 10 min;
   with a camera frame every unit 30 s and 2 min), into another slot: seconds of
   conversation restored per second of wall time, against stepping the same units live
   (from the original's step times), split by part; then the restored slot steps the next
   `--check` units and its records, words and voice must equal the original's (the run
   fails otherwise).

The ratios are what carries over (step over 1 s and over the floor; restore pace): the
absolute times of a 128-wide model on a shared 2-core CPU say nothing of the 8B model on a
GPU. Needs torch and transformers: run with `.venv-minicpmo/bin/python -m
bench.minicpmo_step`. Writes the `minicpmo_step` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
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

RATE = 16_000
UNIT_SAMPLES = 16_000
UNIT_S = 1.0
#: a conversation's first units are its start (the mel's leading zeros, the encoder's
#: first positions), not its steady state: stepped, not timed
SKIP_UNITS = 2
#: units of a throwaway conversation on every slot before anything is timed
WARM_UNITS = 3
#: units restored, untimed, before the measured restores
WARM_RESTORE_UNITS = 4
PROMPT = "You are a helpful assistant."
#: the camera frames: what a webcam sends at one frame a second
CAMERA_SIZE = (640, 480)
JPEG_QUALITY = 85
#: distinct frames per slot, cycled (the vision tower's cost depends on the size, not
#: the picture)
CAMERA_BANK = 4
#: a sized record's length prefix in the history key
LENGTH_PREFIX = 4

#: the parts of a unit, in the order of the table
STEP_PARTS = (
    "jpeg",
    "mel",
    "encoder",
    "vision",
    "prefill",
    "decide",
    "speech",
    "vocoder",
    "rest",
)
PART_NAMES = {
    "jpeg": "JPEG decode",
    "mel": "mel (per slot)",
    "encoder": "audio encoder",
    "vision": "vision",
    "prefill": "LM prefill",
    "decide": "decision steps",
    "speech": "speech model",
    "vocoder": "vocoder (per slot)",
    "rest": "rest",
}
RESTORE_PARTS = ("mel", "encoder", "vision", "lm", "speech", "rest")


# ---------------------------------------------------------------------------- inputs


def _voiced(rng: np.random.Generator, t: np.ndarray) -> np.ndarray:
    """A second of voiced syllables: a gliding f0 with harmonics shaped by two formants,
    gated at a syllable rate, over breath noise."""
    f0 = rng.uniform(90.0, 240.0) * (1 + 0.08 * np.sin(2 * np.pi * rng.uniform(0.5, 3.0) * t))
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    formants = rng.uniform([300.0, 900.0], [900.0, 2500.0])
    voiced = np.zeros_like(t)
    for k in range(1, 16):
        gain = sum(np.exp(-(((k * f0.mean() - f) / 250.0) ** 2)) for f in formants) + 0.05
        voiced += gain / k * np.sin(k * phase)
    gate = np.clip(np.sin(2 * np.pi * rng.uniform(2.5, 6.0) * t + rng.uniform(0, 6.3)), 0, None)
    level = rng.uniform(0.15, 0.5)
    return level * (voiced / np.abs(voiced).max() * gate**0.7 + 0.02 * rng.standard_normal(t.size))


def _room(rng: np.random.Generator, size: int) -> np.ndarray:
    return rng.standard_normal(size) * 10 ** rng.uniform(-4.0, -3.3)


def conversation_audio(seed: int, units: int) -> np.ndarray:
    """`units` 1 s units [units, 16000] of one user (float32, exactly pcm16): turns of 1-4
    units of speech, the last ending mid-unit, then 2-5 units of room tone; the voice and
    the plan differ per seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(UNIT_SAMPLES) / RATE
    bank = [_voiced(rng, t) for _ in range(6)]  # this speaker's syllables
    out = np.empty((units, UNIT_SAMPLES))
    unit = 0
    while unit < units:
        for index in range(int(rng.integers(1, 5))):
            if unit == units:
                break
            speech = bank[int(rng.integers(len(bank)))].copy()
            if index and rng.random() < 0.35:  # the sentence ends within the unit
                cut = int(rng.integers(4000, 12000))
                speech[cut:] = _room(rng, UNIT_SAMPLES - cut)
            out[unit] = speech
            unit += 1
        for _ in range(int(rng.integers(2, 6))):
            if unit == units:
                break
            out[unit] = _room(rng, UNIT_SAMPLES)
            unit += 1
    clipped = np.clip(out, -1.0, 32767 / 32768)
    return (np.round(clipped * 32768) / 32768).astype(np.float32)


def camera_frames(seed: int, count: int = CAMERA_BANK) -> list[bytes]:
    """`count` JPEGs of a seeded scene (gradients, discs that move from frame to frame,
    sensor grain), 640x480 at quality 85: what a webcam client sends."""
    from PIL import Image

    rng = np.random.default_rng(10_000 + seed)
    width, height = CAMERA_SIZE
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.empty((height, width, 3), np.float32)
    for channel in range(3):
        a, b, c = rng.uniform(-1, 1, size=3)
        base[..., channel] = 128 + 60 * (a * x / width + b * y / height) + 40 * c
    discs = [
        (
            rng.uniform(0, width),
            rng.uniform(0, height),
            rng.uniform(30, 120),
            rng.uniform(0, 255, 3),
        )
        for _ in range(4)
    ]
    frames = []
    for index in range(count):
        image = base.copy()
        for cx, cy, radius, colour in discs:
            inside = (x - cx - 15 * index) ** 2 + (y - cy) ** 2 < radius * radius
            image[inside] = colour
        image += rng.normal(0, 4, size=image.shape).astype(np.float32)
        buffer = io.BytesIO()
        Image.fromarray(np.clip(np.round(image), 0, 255).astype(np.uint8), "RGB").save(
            buffer, format="JPEG", quality=JPEG_QUALITY
        )
        frames.append(buffer.getvalue())
    return frames


# ---------------------------------------------------------------------------- timing


class PartClock:
    """Wall time per part of a unit, from wrappers set as instance attributes on the
    engine's objects (the classes untouched; `unwrap` takes them off)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.lm_calls = 0
        self.replaying = False
        self._wrapped: list[tuple[Any, str]] = []

    def reset(self) -> None:
        self.spent = defaultdict(float)
        self.lm_calls = 0

    def wrap(self, owner: Any, attribute: str, part: str | Callable[[], str]) -> None:
        function = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            name = part if isinstance(part, str) else part()
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - started

        setattr(owner, attribute, timed)
        self._wrapped.append((owner, attribute))

    def _lm_part(self) -> str:
        self.lm_calls += 1
        if self.replaying:
            return "lm"
        return "prefill" if self.lm_calls == 1 else "lm_decide"

    def _loop_part(self) -> str:
        self.lm_calls = 0  # the unit's first language-model forward is its prefill
        return "loop"

    def instrument(self, model: Any) -> None:
        engine = model.engine
        weights = engine.weights
        self.wrap(engine, "_frames", "jpeg")
        self.wrap(weights.audio, "step", "encoder")
        self.wrap(weights.audio, "replay", "encoder")
        self.wrap(weights.vision, "embed_frames", "vision")
        self.wrap(weights.language, "forward", self._lm_part)
        self.wrap(weights.speech, "generate", "speech")
        self.wrap(weights.speech, "condition", "speech")
        self.wrap(engine.loop, "step", self._loop_part)
        self.wrap(engine.loop, "finish_replay", "speech")

    def instrument_slot(self, model: Any, slot: int) -> None:
        """A slot's mel stream and voice stream: made when the slot is opened."""
        slot_input = model.engine.inputs[slot]
        self.wrap(slot_input.mel, "push", "mel")
        self.wrap(slot_input.voice, "push", "vocoder")

    def unwrap(self) -> None:
        for owner, attribute in reversed(self._wrapped):
            with contextlib.suppress(AttributeError):
                delattr(owner, attribute)
        self._wrapped.clear()

    def step_parts(self, total: float) -> dict[str, float]:
        """A unit's parts (seconds), summing to `total`."""
        s = self.spent
        parts = {name: s.get(name, 0.0) for name in ("jpeg", "mel", "encoder", "vision")}
        parts["prefill"] = s.get("prefill", 0.0)
        parts["speech"] = s.get("speech", 0.0)
        # the decision steps: the loop's time but its prefill and its speech model (their
        # forwards are s["lm_decide"]; the rest is sampling, bookkeeping and the window)
        parts["decide"] = s.get("loop", 0.0) - parts["prefill"] - parts["speech"]
        parts["decide_forwards"] = s.get("lm_decide", 0.0)
        parts["vocoder"] = s.get("vocoder", 0.0)
        outside = sum(parts[name] for name in STEP_PARTS if name not in ("rest",))
        parts["rest"] = total - outside
        return parts

    def restore_parts(self, total: float) -> dict[str, float]:
        s = self.spent
        parts = {
            "mel": s.get("mel", 0.0),
            "encoder": s.get("encoder", 0.0),
            "vision": s.get("vision", 0.0),
            "lm": s.get("lm", 0.0),
            "speech": s.get("speech", 0.0) + s.get("vocoder", 0.0),
        }
        parts["rest"] = total - sum(parts.values())
        return parts


# ---------------------------------------------------------------------------- results


@dataclasses.dataclass
class Level:
    """One slot count of one series: the measured units."""

    slots: int
    cameras: int
    step_s: list[float] = dataclasses.field(default_factory=list)
    parts: list[dict[str, float]] = dataclasses.field(default_factory=list)
    lm_forwards: list[int] = dataclasses.field(default_factory=list)
    memory: list[float] = dataclasses.field(default_factory=list)
    speaking: int = 0
    slot_units: int = 0
    prefill_positions: int = 0
    floor_s: float = float("nan")

    @property
    def p50(self) -> float:
        return statistics.median(self.step_s)

    @property
    def p95(self) -> float:
        return percentile(sorted(self.step_s), 0.95)

    def mean_part(self, name: str) -> float:
        return statistics.fmean(p[name] for p in self.parts)

    @property
    def mean_step(self) -> float:
        return statistics.fmean(self.step_s)

    @property
    def decisions(self) -> int:
        """The mean unit's one-position forwards (rounded): its decision steps."""
        return max(0, round(statistics.fmean(self.lm_forwards)) - 1)


@dataclasses.dataclass
class Conversation:
    """One slot stepped alone: its records, voice, words and step times."""

    audio: np.ndarray
    images: list[tuple[bytes, ...]]
    records: list[bytes] = dataclasses.field(default_factory=list)
    voice: list[np.ndarray] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    speaking: list[bool] = dataclasses.field(default_factory=list)
    step_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Restore:
    units: int
    camera: bool
    wall_s: float
    calls: int
    stepping_s: float
    memory: int
    parts: dict[str, float]
    checked: int
    equal: int

    @property
    def pace(self) -> float:
        return self.units * UNIT_S / self.wall_s


# ---------------------------------------------------------------------------- the runs


def options(seed: int) -> dict[str, Any]:
    return {"system_prompt": PROMPT, "seed": seed}


def warm(model: Any, audio: np.ndarray, banks: list[list[bytes]]) -> None:
    """A throwaway conversation on every slot (a camera on each), so the measured ones run
    on warm kernels and allocator, as a worker's do once it has served anything."""
    for slot in range(model.slots):
        model.open_slot(slot, options(900 + slot))
    active = np.ones(model.slots, dtype=bool)
    for unit in range(WARM_UNITS):
        images = [(banks[slot][unit % CAMERA_BANK],) for slot in range(model.slots)]
        model.step(audio[:, unit], active, images)
    for slot in range(model.slots):
        model.close_slot(slot)


def run_level(
    model: Any,
    clock: PartClock,
    audio: np.ndarray,
    banks: list[list[bytes]],
    slots: int,
    cameras: bool,
    units: int,
) -> Level:
    """`slots` fresh conversations stepped together for SKIP_UNITS + `units` units; the
    last `units` timed. With `cameras`, slots 0, 2, ... send a frame every unit."""
    seeing = [cameras and slot % 2 == 0 for slot in range(slots)]
    level = Level(slots, sum(seeing))
    for slot in range(slots):
        model.open_slot(slot, options(slot))
        clock.instrument_slot(model, slot)
    active = np.zeros(model.slots, dtype=bool)
    active[:slots] = True
    memory = model.engine.loop.memory
    for unit in range(SKIP_UNITS + units):
        frames = np.zeros((model.slots, UNIT_SAMPLES), np.float32)
        frames[:slots] = audio[:slots, unit]
        images: list[tuple[bytes, ...]] = [()] * model.slots
        for slot in range(slots):
            if seeing[slot]:
                images[slot] = (banks[slot][unit % CAMERA_BANK],)
        clock.reset()
        started = time.perf_counter()
        outputs = model.step(frames, active, images)
        spent = time.perf_counter() - started
        if unit < SKIP_UNITS:
            continue
        level.step_s.append(spent)
        level.parts.append(clock.step_parts(spent))
        level.lm_forwards.append(clock.lm_calls)
        level.memory.append(statistics.fmean(memory.length(slot) for slot in range(slots)))
        level.speaking += sum(1 for output in outputs[:slots] if output and output.speaking)
        level.slot_units += slots
    level.prefill_positions = 1 + 10 + (66 if level.cameras else 0)
    for slot in range(slots):
        model.close_slot(slot)
    return level


def measure_floor(language: Any, level: Level, repeats: int) -> float:
    """The unit's language-model forwards as transformers runs them: a bare
    `Qwen3ForCausalLM` of the same config, its own `DynamicCache` filled to the slots' mean
    memory length; one forward of the prefill positions then `decisions` one-position
    forwards, the logits of the last position each time. Median over `repeats`."""
    import torch
    from transformers import DynamicCache, Qwen3ForCausalLM

    from plugins.minicpmo.language import qwen3_config

    torch.manual_seed(0)
    bare = Qwen3ForCausalLM(qwen3_config(language.config)).eval()
    hidden = language.config.hidden_size
    past = round(statistics.fmean(level.memory))
    batch = level.slots
    generator = torch.Generator().manual_seed(1)

    def embeds(positions: int) -> torch.Tensor:
        return torch.randn(batch, positions, hidden, generator=generator)

    spent = []
    with torch.inference_mode():
        cache = DynamicCache(config=bare.config)
        bare(inputs_embeds=embeds(past), past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill, step = embeds(level.prefill_positions), embeds(1)
        for _ in range(repeats):
            started = time.perf_counter()
            bare(inputs_embeds=prefill, past_key_values=cache, use_cache=True, logits_to_keep=1)
            for _ in range(level.decisions):
                bare(inputs_embeds=step, past_key_values=cache, use_cache=True, logits_to_keep=1)
            spent.append(time.perf_counter() - started)
            cache.crop(-(level.prefill_positions + level.decisions))
    return statistics.median(spent)


def converse(
    model: Any, slot: int, audio: np.ndarray, images: list[tuple[bytes, ...]]
) -> Conversation:
    """One conversation stepped alone in `slot` (the others inactive) to its end."""
    conversation = Conversation(audio, images)
    model.open_slot(slot, options(slot))
    active = np.zeros(model.slots, dtype=bool)
    active[slot] = True
    for unit in range(len(audio)):
        frames = np.zeros((model.slots, UNIT_SAMPLES), np.float32)
        frames[slot] = audio[unit]
        step_images: list[tuple[bytes, ...]] = [()] * model.slots
        step_images[slot] = images[unit]
        started = time.perf_counter()
        output = model.step(frames, active, step_images)[slot]
        conversation.step_s.append(time.perf_counter() - started)
        assert output is not None
        conversation.records.append(output.record)
        conversation.voice.append(output.audio)
        conversation.text.append(output.text)
        conversation.speaking.append(output.speaking)
    model.close_slot(slot)
    return conversation


def history(records: Sequence[bytes]) -> bytes:
    """Records in the history key's sized layout: each after its uint32 LE length."""
    return b"".join(len(r).to_bytes(LENGTH_PREFIX, "little") + r for r in records)


def restore(
    model: Any,
    clock: PartClock,
    slot: int,
    original: Conversation,
    original_slot: int,
    units: int,
    check: int,
) -> Restore:
    """The original's first `units` records restored into `slot` (`restore_slot`, then
    `replay_work` of `replay_chunk_frames` until none is pending), timed; then `check`
    more units stepped and compared with the original's, record, words and voice."""
    data = history(original.records[:units])
    clock.reset()
    clock.replaying = True
    started = time.perf_counter()
    model.restore_slot(slot, options(original_slot), data)
    clock.instrument_slot(model, slot)
    calls = 0
    while model.replay_pending(slot):
        model.replay_work(slot, model.replay_chunk_frames)
        calls += 1
    wall = time.perf_counter() - started
    clock.replaying = False
    parts = clock.restore_parts(wall)
    memory = model.engine.loop.memory.length(slot)
    active = np.zeros(model.slots, dtype=bool)
    active[slot] = True
    equal = 0
    for unit in range(units, min(units + check, len(original.records))):
        frames = np.zeros((model.slots, UNIT_SAMPLES), np.float32)
        frames[slot] = original.audio[unit]
        step_images: list[tuple[bytes, ...]] = [()] * model.slots
        step_images[slot] = original.images[unit]
        output = model.step(frames, active, step_images)[slot]
        assert output is not None
        if (
            output.record == original.records[unit]
            and output.text == original.text[unit]
            and np.array_equal(output.audio, original.voice[unit])
        ):
            equal += 1
    model.close_slot(slot)
    checked = min(check, len(original.records) - units)
    stepping = sum(original.step_s[:units])
    return Restore(
        units, bool(original.images[0]), wall, calls, stepping, memory, parts, checked, equal
    )


# ---------------------------------------------------------------------------- tables


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def step_table(levels: list[Level]) -> list[str]:
    rows = [
        "| slots | camera frames a unit | step p50 / p95 | p95 / 1 s | p50 per slot "
        "| LM forwards a unit | memory a slot (positions) | floor: bare transformers LM "
        "| step / floor | our LM forwards / floor | speaking slot-units |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for level in levels:
        ours_lm = level.mean_part("prefill") + level.mean_part("decide_forwards")
        rows.append(
            f"| {level.slots} | {level.cameras} | {ms(level.p50)} / {ms(level.p95)} ms "
            f"| **{level.p95 / UNIT_S:.3f}** | {ms(level.p50 / level.slots)} ms "
            f"| {statistics.fmean(level.lm_forwards):.1f} "
            f"| {statistics.fmean(level.memory):,.0f} | {ms(level.floor_s)} ms "
            f"| {level.p50 / level.floor_s:.1f}x | {ours_lm / level.floor_s:.2f}x "
            f"| {level.speaking} of {level.slot_units} |"
        )
    return rows


def parts_table(levels: list[Level]) -> list[str]:
    header = " | ".join(PART_NAMES[name] for name in STEP_PARTS)
    rows = [
        f"| slots | cameras | {header} | mean step |",
        "|---|---|" + "---|" * len(STEP_PARTS) + "---|",
    ]
    for level in levels:
        cells = []
        for name in STEP_PARTS:
            cell = ms(level.mean_part(name))
            if name == "decide":
                cell += f" ({ms(level.mean_part('decide_forwards'))})"
            cells.append(cell)
        rows.append(
            f"| {level.slots} | {level.cameras} | "
            + " | ".join(cells)
            + f" | {ms(level.mean_step)} |"
        )
    return rows


@dataclasses.dataclass
class RecordSizes:
    label: str
    listening: list[int]
    speaking: list[int]

    @property
    def total(self) -> int:
        return sum(self.listening) + sum(self.speaking)

    @property
    def units(self) -> int:
        return len(self.listening) + len(self.speaking)

    @property
    def per_minute(self) -> float:
        """Bytes in the history key a minute, length prefixes included."""
        return (self.total + LENGTH_PREFIX * self.units) * 60 / (self.units * UNIT_S)


def sizes_of(label: str, conversation: Conversation, units: int) -> RecordSizes:
    listening = [
        len(r)
        for r, s in zip(conversation.records[:units], conversation.speaking[:units], strict=True)
        if not s
    ]
    speaking = [
        len(r)
        for r, s in zip(conversation.records[:units], conversation.speaking[:units], strict=True)
        if s
    ]
    return RecordSizes(label, listening, speaking)


def spread(values: list[int]) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    mean = statistics.fmean(values)
    return f"{mean:,.0f}" if low == high else f"{mean:,.0f} ({low:,}-{high:,})"


def record_table(sizes: list[RecordSizes], units: int) -> list[str]:
    rows = [
        f"| {units}-unit conversation | listening units: n, bytes | speaking units: n, bytes "
        "(range) | records | in the history key a minute (+4 B each) | an hour |",
        "|---|---|---|---|---|---|",
    ]
    for s in sizes:
        rows.append(
            f"| {s.label} | {len(s.listening)}, {spread(s.listening)} | {len(s.speaking)}, "
            f"{spread(s.speaking)} | {s.total:,} B | **{s.per_minute / 1e6:.2f} MB** "
            f"| {s.per_minute * 60 / 1e6:.0f} MB |"
        )
    return rows


def minutes(units: int) -> str:
    return f"{units} s" if units < 60 else f"{units / 60:g} min"


def restore_table(restores: list[Restore], chunk: int) -> list[str]:
    rows = [
        "| history | camera | restore | **pace** (conversation s / wall s) "
        f"| `replay_work` calls ({chunk} units) | stepping the same units | stepping / restore "
        "| of which mel / encoder / vision / LM / speech+vocoder / rest | memory after (positions) "
        "| next units equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in restores:
        parts = " / ".join(f"{r.parts[name]:.2f}" for name in RESTORE_PARTS)
        rows.append(
            f"| {minutes(r.units)} ({r.units} units) | {'every unit' if r.camera else 'no'} "
            f"| {r.wall_s:.2f} s | **{r.pace:.1f}x** | {r.calls} | {r.stepping_s:.2f} s "
            f"| {r.stepping_s / r.wall_s:.1f}x | {parts} s | {r.memory:,} "
            f"| {r.equal} of {r.checked} |"
        )
    return rows


def step_summary(levels: list[Level]) -> str:
    """What the step tables say, in words, from this run's figures."""
    plain = [level for level in levels if not level.cameras]
    seeing = [level for level in levels if level.cameras]
    text = []
    if len(plain) > 1:
        first, last = plain[0], plain[-1]
        largest = sorted(STEP_PARTS, key=last.mean_part, reverse=True)[:3]
        sublinear = last.p50 / first.p50 < last.slots / first.slots
        text.append(
            f"From {first.slots} to {last.slots} slots (audio only) the unit's p50 goes from "
            f"{ms(first.p50)} to {ms(last.p50)} ms: {last.p50 / first.p50:.1f}x the time for "
            f"{last.slots / first.slots:g}x the sessions, {ms(last.p50 / last.slots)} ms a "
            "session"
            + (
                " (the batch shares a forward's fixed cost, Python and small kernels, which "
                "is most of a forward on this tiny model)"
                if sublinear
                else ""
            )
            + ". The batched parts, one forward for all slots: audio encoder "
            f"{ms(first.mean_part('encoder'))} -> {ms(last.mean_part('encoder'))} ms, prefill "
            f"{ms(first.mean_part('prefill'))} -> {ms(last.mean_part('prefill'))}, decision "
            f"steps {ms(first.mean_part('decide'))} -> {ms(last.mean_part('decide'))} (a "
            "unit takes as many as its longest-speaking slot), speech model "
            f"{ms(first.mean_part('speech'))} -> {ms(last.mean_part('speech'))}; the per-slot "
            f"mel {ms(first.mean_part('mel') / first.slots)} -> "
            f"{ms(last.mean_part('mel') / last.slots)} ms a slot (each unit's log-mel is "
            "computed over the slot's buffer, up to 30 s of audio, as the reference "
            f"computes it). At {last.slots} slots the largest parts are "
            + ", ".join(
                f"{PART_NAMES[name].removesuffix(' (per slot)')} ({ms(last.mean_part(name))} ms)"
                for name in largest
            )
            + "."
        )
    if seeing:
        one, most = seeing[0], seeing[-1]
        text.append(
            f"A camera frame costs {ms(one.mean_part('vision') / one.cameras)} ms of vision "
            f"and {ms(one.mean_part('jpeg') / one.cameras)} ms of JPEG decoding and resizing "
            f"at {one.slots} slot{'s' if one.slots > 1 else ''} "
            f"({ms(most.mean_part('vision') / most.cameras)} and "
            f"{ms(most.mean_part('jpeg') / most.cameras)} ms a frame with {most.cameras} "
            f"frame{'s' if most.cameras > 1 else ''} at {most.slots} slots): the vision "
            "tower does not shrink with the model's width as the rest does (its cost is in "
            f"the 1,036 patches of a frame), so at {most.slots} slots vision is "
            f"{most.mean_part('vision') / most.mean_step:.0%} of the unit."
        )
    return " ".join(text)


def restore_summary(restores: list[Restore], live_vision_ms: float | None) -> str:
    text = []
    plain = [r for r in restores if not r.camera]
    seeing = [r for r in restores if r.camera]
    if plain:
        r = plain[-1]
        largest = max(RESTORE_PARTS, key=lambda name: r.parts[name])
        text.append(
            f"Without a camera, {minutes(r.units)} of history is restored in "
            f"{r.wall_s:.2f} s: {r.pace:.0f}x real time, {r.stepping_s / r.wall_s:.1f}x "
            f"faster than stepping it; its largest part is the {largest} "
            f"({r.parts[largest]:.2f} s of {r.wall_s:.2f}). The language model takes a "
            f"chunk's units in one forward ({r.parts['lm']:.2f} s in all, "
            f"{r.parts['lm'] / r.units * 1000:.2f} ms a unit); the mel is computed unit by "
            "unit, each over the buffer as it stood after that unit, as live "
            f"({r.parts['mel'] / r.units * 1000:.2f} ms a unit)."
        )
    if seeing:
        r = seeing[-1]
        per_frame = r.parts["vision"] / r.units * 1000
        sentence = (
            f"With a camera frame every unit, {minutes(r.units)} is restored at "
            f"{r.pace:.0f}x real time, {r.stepping_s / r.wall_s:.1f}x stepping it: the "
            f"vision tower takes {r.parts['vision']:.2f} s ({per_frame:.1f} ms a frame) and "
            f"the rest, mostly decoding the JPEGs again, {r.parts['rest']:.2f} s"
        )
        if live_vision_ms is not None and per_frame > live_vision_ms:
            sentence += (
                f"; live, one frame alone took {live_vision_ms:.1f} ms of vision: the "
                "replay embeds up to 16 frames in one forward, which on this CPU costs more "
                "a frame than one frame at a time"
            )
        text.append(sentence + ".")
    if restores:
        equal = sum(r.equal for r in restores)
        checked = sum(r.checked for r in restores)
        text.append(
            f"After every restore the slot stepped on exactly as the original ({equal} of "
            f"{checked} units equal, record, words and voice)."
            if equal == checked
            else f"After a restore the slot did NOT always step as the original: {equal} of "
            f"{checked} units equal."
        )
    return " ".join(text)


def deployment(levels: list[Level], restores: list[Restore]) -> str:
    """What a real deployment differs in, with the figures of this run that carry over."""
    plain = [level for level in levels if not level.cameras]
    mel = ""
    if plain:
        level = plain[-1]
        mel = (
            f": {ms(level.mean_part('mel') / level.slots)} ms a slot a unit in the timed "
            "units above"
        )
        long = [r for r in restores if not r.camera and r.units >= 60]
        if long:
            mel += (
                f", {long[-1].parts['mel'] / long[-1].units * 1000:.1f} ms a unit in the "
                f"{minutes(long[-1].units)} restore, whose buffers hold up to 30 s"
            )
    return (
        "**What a real deployment differs in (unmeasured here).** The published model is "
        "about 8B parameters (Qwen3-8B, Whisper-medium's encoder, SigLIP2 with the "
        "resampler, a Llama speech model) in bfloat16 on a GPU, and speaks through "
        "Step-Audio2's `Token2wav` (flow matching and HiFT, a stream per slot, on the GPU; "
        "here a tone per code). None of that ran here: the unit's time per slot on a GPU, "
        "how it grows with the slots, the vocoder's share, how many sessions a GPU keeps "
        "within the 1 s unit and how fast it restores are not measured, and this tiny "
        "model's proportions (a forward's fixed cost, Python and small kernels, being most "
        "of it) are not the 8B model's. What does carry over is the CPU work the worker "
        f"does whatever the device: each slot's mel (torch's STFT on the CPU{mel}), each "
        "camera frame's JPEG decoding and resizing, the choice of every token and code "
        "(Python over each slot's logits); and the arithmetic of the language model's "
        "memory, 36 layers x 8 key/value heads x 128 x 2 (keys, values) x 2 bytes = 147 kB "
        "a position in bfloat16, 1.2 GB a slot at the 8,000-position window."
    )


# ---------------------------------------------------------------------------- main


def parse_sizes(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n.strip()]


def main(args: argparse.Namespace) -> None:
    quick = args.quick
    slot_counts = parse_sizes(args.slots or ("1,2" if quick else "1,2,4,8"))
    units = args.units or (3 if quick else 30)
    camera_units = args.camera_units or (2 if quick else 20)
    record_units = args.record_units or (6 if quick else 60)
    sizes = parse_sizes(args.restore or ("4,8" if quick else "30,120,300,600"))
    camera_sizes = parse_sizes(
        args.restore_camera if args.restore_camera is not None else ("4" if quick else "30,120")
    )
    check = args.check
    repeats = 2 if quick else 7
    if min(slot_counts) < 1 or check < 1:
        raise SystemExit("--slots and --check must be positive")

    import torch

    from plugins.minicpmo.builder import build_tiny_checkpoint
    from plugins.minicpmo.plugin import MiniCPMOPlugin

    load_at_start = os.getloadavg()[0]
    started = time.monotonic()
    slots = max(max(slot_counts), 2)
    longest = max([record_units, *sizes]) + check
    longest_camera = max([record_units, *camera_sizes]) + check
    step_units = SKIP_UNITS + max(units, camera_units)
    audio = np.stack(
        [conversation_audio(1 + slot, max(step_units, WARM_UNITS)) for slot in range(slots)]
    )
    banks = [camera_frames(slot) for slot in range(slots)]
    jpeg_sizes = [len(frame) for bank in banks for frame in bank]
    talk = conversation_audio(100, max(longest, longest_camera))
    talk_bank = camera_frames(100)
    with tempfile.TemporaryDirectory(prefix="tiny-minicpmo-") as directory:
        checkpoint = build_tiny_checkpoint(Path(directory) / "tiny", seed=0)
        plugin = MiniCPMOPlugin(checkpoint, decode="greedy", vocoder="tone", threads=args.threads)
        model = plugin.frame_model(slots)
        threads = torch.get_num_threads()
        weights = model.engine.weights
        params = {
            name: sum(p.numel() for p in getattr(weights, name).parameters())
            for name in ("language", "audio", "vision", "speech")
        }
        warm(model, audio, banks)
        clock = PartClock()
        clock.instrument(model)

        levels: list[Level] = []
        for cameras, measured in ((False, units), (True, camera_units)):
            for count in slot_counts:
                level = run_level(model, clock, audio, banks, count, cameras, measured)
                level.floor_s = measure_floor(weights.language, level, repeats)
                levels.append(level)
                print(
                    f"{count} slot(s), {level.cameras} camera(s): p50 {ms(level.p50)} ms, "
                    f"p95 {ms(level.p95)} ms; floor {ms(level.floor_s)} ms",
                    flush=True,
                )

        originals = {
            False: converse(model, 0, talk[:longest], [()] * longest),
            True: converse(
                model,
                0,
                talk[:longest_camera],
                [(talk_bank[u % CAMERA_BANK],) for u in range(longest_camera)],
            ),
        }
        record_sizes = [
            sizes_of("audio only", originals[False], record_units),
            sizes_of("a camera frame every unit", originals[True], record_units),
        ]
        for s in record_sizes:
            print(f"records, {s.label}: {s.per_minute / 1e6:.2f} MB a minute", flush=True)
        talk_jpeg = [len(frame) for frame in talk_bank]

        restore(model, clock, 1, originals[False], 0, WARM_RESTORE_UNITS, 1)
        restores: list[Restore] = []
        for camera, lengths in ((False, sizes), (True, camera_sizes)):
            for length in lengths:
                result = restore(model, clock, 1, originals[camera], 0, length, check)
                restores.append(result)
                print(
                    f"restore {length} units{' with camera' if camera else ''}: "
                    f"{result.wall_s:.2f} s ({result.pace:.1f}x real time), next units equal "
                    f"{result.equal} of {result.checked}",
                    flush=True,
                )
        clock.unwrap()
        chunk = model.replay_chunk_frames
        window = model.engine.settings.window
    elapsed = time.monotonic() - started

    command = ".venv-minicpmo/bin/python -m bench.minicpmo_step" + (" --quick" if quick else "")
    for flag, value in [
        ("--slots", args.slots),
        ("--units", args.units),
        ("--camera-units", args.camera_units),
        ("--record-units", args.record_units),
        ("--restore", args.restore),
        ("--restore-camera", args.restore_camera),
    ]:
        if value is not None:
            command += f" {flag} {value}"
    if check != 3:
        command += f" --check {check}"
    if args.threads != 1:
        command += f" --threads {args.threads}"
    changed = dirty(["plugins/minicpmo", "bench/minicpmo_step.py"])
    single_camera = [level for level in levels if level.cameras == 1 and level.slots == 1]
    live_vision_ms = single_camera[0].mean_part("vision") * 1000 if single_camera else None
    body = [
        f"Measured {now_utc()} on {machine()} (`nproc` {os.cpu_count()}), commit {commit()}"
        + (f" with uncommitted changes in {changed}" if changed else "")
        + f": `{command}` ({elapsed:.0f} s). torch {torch.__version__}, {threads} thread"
        f"{'s' if threads != 1 else ''}. Load average (1 min) {load_at_start:.2f} at the "
        f"start, {os.getloadavg()[0]:.2f} at the end.",
        "",
        "The tiny random MiniCPM-o 4.5 of `plugins/minicpmo/builder.py` (seed 0; "
        f"{sum(params.values()):,} parameters: language model {params['language']:,} (Qwen3, "
        f"2 layers of width 128), audio {params['audio']:,} (Whisper, 2 layers of width 32), "
        f"vision {params['vision']:,} (SigLIP, 2 layers of width 32, and the resampler), "
        f"speech model {params['speech']:,} (Llama, 2 layers of width 16)), float32, "
        "greedy (text and speech codes argmax), the tone vocoder, through "
        "`MiniCPMOFrameModel` as `MiniCPMOPlugin.frame_model` builds it for "
        f"{slots} slots, the sliding window at {window.high:,} / {window.low:,} positions. "
        "Each slot is its own user: turns of voiced syllables (a gliding f0 and its "
        "harmonics under two formants, gated at a syllable rate, over breath noise), ending "
        "mid-unit, then pauses of room tone; 16 kHz, exactly pcm16. Camera frames are "
        f"{CAMERA_SIZE[0]}x{CAMERA_SIZE[1]} JPEGs (quality {JPEG_QUALITY}) of a seeded "
        f"scene with moving discs and sensor grain, {min(jpeg_sizes) / 1000:.0f}-"
        f"{max(jpeg_sizes) / 1000:.0f} kB; the model resizes each to about 448² (1,036 "
        "patches of 14 pixels).",
        "",
        f"**Unit step against slots.** {units} units of each slot count timed (camera series: "
        f"{camera_units}) after each conversation's first {SKIP_UNITS}, all slots in one "
        "`step`; the camera series gives slots 0, 2, ... a frame every unit. *p95 / 1 s* "
        "is the share of the unit's real-time budget the slowest units take (the tick must "
        "finish a unit within a second); *memory a slot* is the mean length of the slots' "
        "language-model memory over the timed units (the window slides past 8,000). The "
        "*floor* is the unit's language-model forwards "
        "as transformers runs them, measured in the same run: a bare `Qwen3ForCausalLM` of "
        "the tiny config with its own `DynamicCache` filled to the slots' mean memory "
        "length, one forward of the unit's prefill positions for every slot (11, or 77 with "
        "a camera frame: the longest row), then as many one-position forwards as the unit "
        "took decision steps (median of "
        f"{repeats}). It is the work no implementation of the duplex loop skips, so *step / "
        "floor* is what everything else costs on top (audio, vision, speech, vocoder, "
        "sampling, bookkeeping), and *our LM forwards / floor* what our per-slot memory "
        "(`decoder_stack.py`: any mix of rows, each slot at its own position) costs against "
        "transformers' padded batch on the same shapes.",
        "",
        *step_table(levels),
        "",
        "**A unit by part** (mean ms a unit; wrappers on the engine's objects: JPEG decode "
        "and checks of the camera frames, each slot's mel, the audio encoder, the vision "
        "tower with the resampler, the language model's prefill forward, the decision "
        "steps (in brackets their forwards; the rest is the logits, the choice and the "
        "bookkeeping), the speech-token model (conditions and code steps), each slot's "
        "vocoder stream, and the rest: the input checks, pcm16 quantising, records, "
        "outputs). **Batched** (one forward for all slots): the audio encoder, the vision "
        "tower (all frames of the unit, up to 16 a forward), the prefill, each decision "
        "step (the slots still deciding), each speech-code step (the speaking slots). "
        "**Per slot**: the mel (torch's STFT on the CPU), the vocoder stream, JPEG "
        "decoding, the choice of "
        "each token and code (Python over each slot's logits).",
        "",
        *parts_table(levels),
        "",
        step_summary(levels),
        "",
        f"**Record bytes**: the real records of one conversation's first {record_units} units "
        "(the same audio twice: without a camera and with a frame every unit, "
        f"{CAMERA_SIZE[0]}x{CAMERA_SIZE[1]} JPEGs of {statistics.fmean(talk_jpeg) / 1000:.0f} kB "
        "on average; camera bytes grow with the client's JPEG size and quality, one a "
        "second at most). A unit's record is its pcm16 audio (32,000 bytes), a 4-byte "
        "header, 4 bytes per fed token and 2 per speech code, then each frame's length and "
        "bytes: what the worker appends to the history key, each record after its 4-byte "
        "length.",
        "",
        *record_table(record_sizes, record_units),
        "",
        "**Restore against history.** One conversation stepped alone (slot 0) to the "
        f"longest history plus {check} units; then, for each length, its first records "
        "(as the history key holds them) restored into slot 1: `restore_slot`, then "
        f"`replay_work(slot, {chunk})` (the plugin's `replay_chunk_frames`) until nothing "
        f"is pending (after an untimed {WARM_RESTORE_UNITS}-unit restore). *Pace* is seconds "
        "of conversation restored per second of wall time (> 1: faster than real time); "
        "*stepping the same units* is what the original's live steps of those units took; "
        "the parts are each unit's mel, the audio encoder (a chunk's units in one forward), "
        "the vision tower (the chunk's frames), the language model (a chunk's prefills, "
        "fed tokens and `</unit>`s in one forward, split where the window slid), the speech "
        "model's open turn and its codes rendered again through the vocoder, the rest "
        "(decoding the records and the JPEGs, the decision history). Then the restored slot "
        f"steps the next {check} units of the original's input: *equal* counts the units "
        "whose record, words and voice are the original's, byte for byte.",
        "",
        *restore_table(restores, chunk),
        "",
        restore_summary(restores, live_vision_ms),
        "",
        deployment(levels, restores),
    ]
    text = "\n".join(body)
    print(text)
    write_section(
        "benchmarks.md",
        args.section,
        text,
        "MiniCPM-o 4.5: unit step against slots, record bytes, restore against history "
        "(`bench/minicpmo_step.py`)" + (f", {args.label}" if args.label else ""),
        docs=args.docs,
    )
    unequal = [r for r in restores if r.equal != r.checked]
    if unequal:
        raise SystemExit(
            "a restored slot did not step as the original: "
            + ", ".join(f"{r.units} units{' (camera)' if r.camera else ''}" for r in unequal)
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--slots", default=None, help="active slots, comma-separated (default 1,2,4,8; --quick 1,2)"
    )
    parser.add_argument(
        "--units", type=int, default=None, help="units timed per slot count (default 30; --quick 3)"
    )
    parser.add_argument(
        "--camera-units",
        type=int,
        default=None,
        help="units timed per slot count with cameras (default 20; --quick 2)",
    )
    parser.add_argument(
        "--record-units",
        type=int,
        default=None,
        help="units of the conversation whose records are counted (default 60; --quick 6)",
    )
    parser.add_argument(
        "--restore",
        default=None,
        help="history lengths restored, units, comma-separated (default 30,120,300,600; "
        "--quick 4,8)",
    )
    parser.add_argument(
        "--restore-camera",
        default=None,
        help="history lengths with a camera frame every unit restored (default 30,120; "
        "--quick 4; empty for none)",
    )
    parser.add_argument(
        "--check", type=int, default=3, help="units stepped after a restore and compared"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: one core of a 2-core machine, as the plugin's option)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    add_output_arguments(parser, "minicpmo_step")
    with contextlib.suppress(KeyboardInterrupt):
        main(parser.parse_args())
