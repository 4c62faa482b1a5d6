"""A deterministic frame-clocked model for tests, without torch: `EchoFrameModel` and its
plugin `EchoFramePlugin` (`duplex worker --plugin harness.frame_models:EchoFramePlugin`),
and `ManualClock`, a clock the tests move themselves.

The model speaks back each slot's input `delay_frames` frames later: a frame whose
delayed input has energy (RMS over `SPEECH_RMS`) is a speaking frame carrying that input
as its audio and "." as its text; any other frame is quiet (zeros, no text). A slot's
output depends on its own input only, so the model is batch-invariant by construction;
`steps[slot]` counts the steps a slot was active in, so a test can check that inactive
slots do not advance, and `batches` records how many slots each step served.

Its memory is its step count: each frame's record is the slot's step number (uint32), so a
history is the numbers 1..N, and a restore (`restore_slot`, replayed as many frames per
`replay_work` as the stage asks, `replay_chunk_frames` at most) checks that it is exactly
that (a history with a gap or a repeat is refused) and goes on counting from N. A replayed
frame costs `replay_frame_s` seconds of the model thread (0: free), so a test or a
benchmark can give the replay a cost the stage must schedule around. A barge-in
(`interrupt_slot`) drops what the slot was about to say and keeps its count
(`interrupts[slot]` counts them).

`ToolEchoFrameModel` (`--plugin harness.frame_models:ToolEchoFramePlugin`) makes tool
calls, deterministically: what it does depends on the frames it steps only (never on the
clock or the CPU's speed). Its slot's options hold the session's tools as they were when
it opened (`ToolEchoFramePlugin.prepare_runtime_config`). With tools, and no call of its
own still unanswered, the first loud frame of an utterance it hears (RMS over `SPEECH_RMS`,
after a quiet frame: an utterance calls once at most, an interrupted one included) is a
speaking frame, without audio, that calls the session's first tool with arguments
`{"band": "low"|"high", "call": N}`:

- a low tone (its strongest frequency under `HIGH_BAND_HZ`, e.g. 440 Hz): the model goes
  on "speaking" (frames without audio) while the input is loud, and is quiet after: the
  stage ends the response, and the call reaches the client;
- a high tone (880 Hz): the model speaks (without audio) until it is interrupted (a
  barge-in or cancel), so a test can cancel a response that holds a call at its leisure.

A first tool named `PARSE_ERROR_TOOL` makes the model write a call that does not parse:
that frame is a speaking frame (a frame of its answer tone) with `FrameOutput.error`
(`PARSE_ERROR_CODE`) and no call.
`add_function_output` ends its wait: at its next steps the slot speaks `answer_frames`
frames of a 330 Hz tone, the output as the first frame's text, and is quiet after (a new
response). An interrupt drops what it was saying, its unanswered call included. Its quiet
frames have no audio (a response that only calls a tool sends no audio at all).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from services.worker.stages.tick_clock import TickClock
from shared.contracts import (
    DuplexSessionConfig,
    FrameClockedPlugin,
    FrameModel,
    FrameOutput,
    FunctionCall,
)
from shared.contracts.tools import read_tools

#: RMS above which a frame is speech
SPEECH_RMS = 0.01
RATE = 24_000
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz, Mimi's frame


class EchoFrameModel(FrameModel):
    input_sample_rate_hz = RATE
    output_sample_rate_hz = RATE

    state_record_bytes = 4

    def __init__(
        self,
        slots: int,
        *,
        delay_frames: int = 2,
        frame_samples: int = FRAME_SAMPLES,
        replay_chunk_frames: int = 8,
        replay_frame_s: float = 0.0,
    ) -> None:
        self.slots = slots
        self.replay_chunk_frames = replay_chunk_frames
        self.replay_frame_s = replay_frame_s
        #: frames each `replay_work` call replayed, in call order
        self.replay_calls: list[int] = []
        self.interrupts = [0] * slots
        self.restored = [0] * slots  # frames of history each slot was last restored from
        self._replay_left = [0] * slots
        self.frame_samples = frame_samples
        self.delay_frames = delay_frames
        self.steps = [0] * slots
        self.opened: list[bool] = [False] * slots
        self.options: list[dict[str, Any] | None] = [None] * slots
        self.batches: list[int] = []  # active slots of each step
        self.closed = False
        #: called at each step, on the model thread (a test's slow step)
        self.on_step: Callable[[], None] | None = None
        #: called at each open_slot, on the model thread (a test's open that fails)
        self.on_open: Callable[[int, Mapping[str, Any]], None] | None = None
        self._history = [self._fresh() for _ in range(slots)]

    def _fresh(self) -> deque[np.ndarray]:
        silence = np.zeros(self.frame_samples, np.float32)
        return deque([silence] * self.delay_frames, maxlen=self.delay_frames + 1)

    def open_slot(self, slot: int, options: Mapping[str, Any]) -> None:
        if self.on_open is not None:
            self.on_open(slot, options)
        if self.opened[slot]:
            raise RuntimeError(f"slot {slot} is already open")
        self.opened[slot] = True
        self.options[slot] = dict(options)
        self.steps[slot] = 0
        self._history[slot] = self._fresh()

    def interrupt_slot(self, slot: int) -> None:
        self.interrupts[slot] += 1
        self._history[slot] = self._fresh()

    def restore_slot(self, slot: int, options: Mapping[str, Any], history: bytes) -> None:
        count = len(history) // self.state_record_bytes
        numbers = list(struct.unpack(f"<{count}I", history[: count * self.state_record_bytes]))
        if len(history) % self.state_record_bytes or numbers != list(range(1, count + 1)):
            raise ValueError(f"a history that is not the steps 1..{count}: {numbers[:8]}...")
        self.open_slot(slot, options)
        self.steps[slot] = count
        self.restored[slot] = count
        self._replay_left[slot] = count

    def replay_pending(self, slot: int) -> int:
        return self._replay_left[slot]

    def replay_work(self, slot: int, frames: int) -> int:
        if not 1 <= frames <= self.replay_chunk_frames:
            raise ValueError(f"asked to replay {frames} frames (1..{self.replay_chunk_frames})")
        done = min(frames, self._replay_left[slot])
        if self.replay_frame_s:
            time.sleep(done * self.replay_frame_s)  # the model thread busy, as a real replay
        self.replay_calls.append(done)
        self._replay_left[slot] -= done
        return self._replay_left[slot]

    def close_slot(self, slot: int) -> None:
        self.opened[slot] = False
        self.options[slot] = None
        self._replay_left[slot] = 0

    def step(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> list[FrameOutput | None]:
        if self.on_step is not None:
            self.on_step()
        assert frames.shape == (self.slots, self.frame_samples) and frames.dtype == np.float32
        self.batches.append(int(active.sum()))
        outputs: list[FrameOutput | None] = []
        for slot in range(self.slots):
            if not active[slot]:
                outputs.append(None)
                continue
            if not self.opened[slot]:
                raise RuntimeError(f"slot {slot} stepped before open_slot")
            if self._replay_left[slot]:
                raise RuntimeError(f"slot {slot} stepped while replaying")
            self.steps[slot] += 1
            record = struct.pack("<I", self.steps[slot])
            history = self._history[slot]
            history.append(frames[slot].copy())
            said = history.popleft()
            speaking = float(np.sqrt(np.mean(said**2))) > SPEECH_RMS
            if speaking:
                outputs.append(FrameOutput(said, ".", True, record))
            else:
                silence = np.zeros(self.frame_samples, np.float32)
                outputs.append(FrameOutput(silence, record=record))
        return outputs

    def close(self) -> None:
        self.closed = True


class EchoFramePlugin(FrameClockedPlugin):
    """The plugin of `EchoFrameModel`. Options (`--plugin-option`): `slots` (the model's
    batch, below the worker's max sessions), `delay_frames`."""

    plugin_id = "frame_echo"
    input_sample_rate_hz: ClassVar[int] = RATE
    output_sample_rate_hz: ClassVar[int] = RATE
    listen_after_ms: ClassVar[float] = 240  # 3 frames

    def __init__(
        self, slots: int | None = None, delay_frames: int = 2, replay_chunk_frames: int = 8
    ) -> None:
        self.slots = slots
        self.delay_frames = delay_frames
        self.replay_chunk_frames = replay_chunk_frames
        self.models: list[EchoFrameModel] = []

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> EchoFramePlugin:
        slots = options.get("slots")
        return cls(
            slots=int(slots) if slots is not None else None,
            delay_frames=int(options.get("delay_frames", 2)),
            replay_chunk_frames=int(options.get("replay_chunk_frames", 8)),
        )

    def frame_model(self, max_sessions: int) -> EchoFrameModel:
        slots = min(max_sessions, self.slots) if self.slots else max_sessions
        model = EchoFrameModel(
            slots, delay_frames=self.delay_frames, replay_chunk_frames=self.replay_chunk_frames
        )
        self.models.append(model)
        return model


#: an input tone whose strongest frequency is at least this is "high" (ToolEchoFrameModel)
HIGH_BAND_HZ = 660.0
#: a first tool of this name makes ToolEchoFrameModel write a call that does not parse
PARSE_ERROR_TOOL = "tool_echo_unparsable"
PARSE_ERROR_CODE = "tool_echo_function_call_parse_error"
#: the tone ToolEchoFrameModel speaks an output with
ANSWER_HZ = 330.0


class ToolEchoFrameModel(FrameModel):
    """A frame model that calls the session's first tool (module head)."""

    input_sample_rate_hz = RATE
    output_sample_rate_hz = RATE
    frame_samples = FRAME_SAMPLES

    def __init__(self, slots: int, *, answer_frames: int = 4) -> None:
        self.slots = slots
        self.answer_frames = answer_frames
        self.opened = [False] * slots
        self.tools: list[list[dict[str, Any]]] = [[] for _ in range(slots)]
        #: calls each slot made, and the outputs it was given: (call_id, name, output)
        self.calls: list[list[FunctionCall]] = [[] for _ in range(slots)]
        self.outputs: list[list[tuple[str, str, str]]] = [[] for _ in range(slots)]
        self.interrupts = [0] * slots
        self._state: list[str] = ["idle"] * slots  # idle | calling | holding
        self._waiting = [False] * slots  # a call of its own is unanswered
        self._loud = [False] * slots  # the last frame it heard was loud
        self._answers: list[deque[tuple[np.ndarray, str]]] = [deque() for _ in range(slots)]

    def open_slot(self, slot: int, options: Mapping[str, Any]) -> None:
        if self.opened[slot]:
            raise RuntimeError(f"slot {slot} is already open")
        self.opened[slot] = True
        self.tools[slot] = [dict(tool) for tool in options.get("tools") or ()]
        self.calls[slot], self.outputs[slot] = [], []  # a new conversation
        self._loud[slot] = False
        self._forget(slot)

    def interrupt_slot(self, slot: int) -> None:
        self.interrupts[slot] += 1
        self._forget(slot)  # what it was saying, its unanswered call included

    def close_slot(self, slot: int) -> None:
        self.opened[slot] = False
        self.tools[slot] = []
        self._forget(slot)

    def _forget(self, slot: int) -> None:
        self._state[slot] = "idle"
        self._waiting[slot] = False
        self._answers[slot].clear()

    def add_function_output(self, slot: int, call_id: str, name: str, output: str) -> None:
        if not self.opened[slot]:
            raise RuntimeError(f"slot {slot} is not open")
        self.outputs[slot].append((call_id, name, output))
        self._waiting[slot] = False
        self._state[slot] = "idle"
        audio = self._tone(self.answer_frames)
        for index in range(self.answer_frames):
            frame = audio[index * self.frame_samples : (index + 1) * self.frame_samples]
            self._answers[slot].append((frame, output if index == 0 else ""))

    def _tone(self, frames: int) -> np.ndarray:
        t = np.arange(frames * self.frame_samples) / RATE
        return (0.2 * np.sin(2 * np.pi * ANSWER_HZ * t)).astype(np.float32)

    def step(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> list[FrameOutput | None]:
        outputs: list[FrameOutput | None] = []
        for slot in range(self.slots):
            if not active[slot]:
                outputs.append(None)
                continue
            if not self.opened[slot]:
                raise RuntimeError(f"slot {slot} stepped before open_slot")
            outputs.append(self._step_slot(slot, frames[slot]))
        return outputs

    def _step_slot(self, slot: int, frame: np.ndarray) -> FrameOutput:
        nothing = np.zeros(0, np.float32)
        loud = float(np.sqrt(np.mean(frame**2))) > SPEECH_RMS
        # an utterance starts: a loud frame after a quiet one (only its first frame calls)
        onset, self._loud[slot] = loud and not self._loud[slot], loud
        if self._answers[slot]:
            audio, text = self._answers[slot].popleft()
            return FrameOutput(audio.copy(), text, True)
        state = self._state[slot]
        if state == "holding" or (state == "calling" and loud):
            return FrameOutput(nothing, speaking=True)  # the call's response goes on
        self._state[slot] = "idle"
        tools = self.tools[slot]
        if not onset or not tools or self._waiting[slot]:
            return FrameOutput(nothing)  # quiet: no audio at all (nothing to send)
        band = "high" if _strongest_hz(frame) >= HIGH_BAND_HZ else "low"
        self._state[slot] = "holding" if band == "high" else "calling"
        name = str(tools[0]["name"])
        if name == PARSE_ERROR_TOOL:  # it says a frame of its answer tone, and a bad call
            message = f"the model wrote a call of {name} that does not parse"
            audio = self._tone(1)
            return FrameOutput(audio, "", True, error=(PARSE_ERROR_CODE, message))
        self._waiting[slot] = True
        arguments = json.dumps({"band": band, "call": len(self.calls[slot]) + 1})
        call = FunctionCall(name, arguments)
        self.calls[slot].append(call)
        return FrameOutput(nothing, speaking=True, function_calls=(call,))


def _strongest_hz(frame: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(frame))
    return float(np.argmax(spectrum[1:]) + 1) * RATE / frame.size


class ToolEchoFramePlugin(FrameClockedPlugin):
    """The plugin of `ToolEchoFrameModel`: the session's tools (as they are at its open) go
    to its slot's options. Options: `answer_frames`."""

    plugin_id = "frame_tool_echo"
    input_sample_rate_hz: ClassVar[int] = RATE
    output_sample_rate_hz: ClassVar[int] = RATE
    listen_after_ms: ClassVar[float] = 240  # 3 frames

    def __init__(self, answer_frames: int = 4) -> None:
        self.answer_frames = answer_frames
        self.models: list[ToolEchoFrameModel] = []

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ToolEchoFramePlugin:
        return cls(answer_frames=int(options.get("answer_frames", 4)))

    async def prepare_runtime_config(self, config: DuplexSessionConfig) -> dict[str, Any]:
        return {"tools": _tools(config)}

    def runtime_config_for_update(
        self, runtime_config: Mapping[str, Any], config: DuplexSessionConfig
    ) -> dict[str, Any]:
        # kept with the session (a restored slot opens with them); an open slot keeps the
        # tools it opened with: a FrameModel has no hook for options that change
        return {**runtime_config, "tools": _tools(config)}

    def frame_model(self, max_sessions: int) -> ToolEchoFrameModel:
        model = ToolEchoFrameModel(max_sessions, answer_frames=self.answer_frames)
        self.models.append(model)
        return model


def _tools(config: DuplexSessionConfig) -> list[dict[str, Any]]:
    return [dict(tool) for tool in read_tools(config.extra_body.get("realtime_tools"))]


#: how long a test waits for the tick to sleep again before it fails
SLEEPER_WAIT_S = 30.0


class ManualClock(TickClock):
    """Time that moves only when the test says: `advance` wakes the sleepers it passes;
    `skew` moves it without waking anyone (a slow step, from any thread)."""

    def __init__(self) -> None:
        self.time = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.time + seconds, next(self._order), future))
        await future

    async def sleep_unless(self, seconds: float, event: asyncio.Event) -> bool:
        if event.is_set():
            return True
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.time + seconds, next(self._order), future))
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({future, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            future.cancel()  # woken early: no longer a sleeper (`next_sleeper` skips it)
            waiter.cancel()
        return event.is_set()

    async def next_sleeper(self) -> float:
        """The due time of the first sleeper, once one sleeps (the tick waits for its
        next frame): a test then moves time exactly there (`advance_to`)."""
        async with asyncio.timeout(SLEEPER_WAIT_S):  # a stalled tick fails the test, not hangs
            while True:
                while self._sleepers and self._sleepers[0][2].done():
                    heapq.heappop(self._sleepers)  # woken early (`sleep_unless`)
                if self._sleepers:
                    return self._sleepers[0][0]
                await asyncio.sleep(0.001)

    async def advance_to(self, when: float) -> None:
        await self.advance(max(0.0, when - self.time))

    def skew(self, seconds: float) -> None:
        self.time += seconds

    async def advance(self, seconds: float) -> None:
        self.time += seconds
        while self._sleepers and self._sleepers[0][0] <= self.time + 1e-9:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)
        await asyncio.sleep(0)


def tone(
    frames: int,
    amplitude: float = 0.3,
    frame_samples: int = FRAME_SAMPLES,
    freq_hz: float = 440.0,
) -> np.ndarray:
    """`frames` frames of a tone (440 Hz unless told) at 24 kHz (speech to the model)."""
    t = np.arange(frames * frame_samples) / RATE
    return (amplitude * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32)
