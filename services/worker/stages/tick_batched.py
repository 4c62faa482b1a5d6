"""`TickBatchedStagePort`: one batched model step per frame for every session of a worker.

A frame-clocked model (`shared/contracts/frame_model.py`) is served by one port per
worker. Each session holds a slot (a row of the batch) from its first `ensure` to its
`cleanup`; its one long-lived stream request (`submit_initial`, payload: the session's
runtime config) opens the slot in the model, and its converted input is `feed`-ed to the
slot's buffer as the runner applies it.

The tick: one task; every `frame_ms` (the model's own clock: 80 ms for Mimi, 1 s for a
model of 1 s units), on a fixed grid (`tick_clock.py`), it takes one frame per open slot
(`slots.py`; a zero frame, counted, when a whole frame has not arrived: the clock never
waits for a slow client; a 1 s unit steps once its client's 20-100 ms chunks make a whole
unit), runs `model.step` on the model thread, and fans the outputs out. The next tick is
due one period after the previous due time; a step that ends past the next due time is a
deadline miss, and the grid points it overran are skipped (no burst of steps to catch up).
With no slot open the task waits on an event, not on the clock.

A client-clocked slot (`StagePlan.client_clock`: a session of Moshi's protocol, whose
reference server steps the model on the client's audio) is stepped on the server's clock
while it steps its prompt, and after that once per whole frame of its client's input, and
only then: a tick that finds no whole frame for it leaves it out of the step (inactive, its
state kept; nothing is sent), so a client that stops sending stops its model. Every frame
it steps goes to its session, the model's quiet ones too ("quiet" outputs, part of no
response): a frame out for every frame in. A slot with more than a frame waiting after the
tick's step (early audio, a burst, a worker that fell behind) steps again, alone with the
others behind, in the time before the next frame (`_catch_up`); its backlog is never more
than `CLIENT_BACKLOG_MS` (the oldest is cut). A slot with no prompt is ready at once, before
any step.

Every `FrameModel` method runs on one dedicated thread (a 1-thread executor), so a step
never overlaps an open, reset or close, and those run between steps in call order.

Turn taking is the model's (`FrameOutput.speaking`): a listening slot's frames are not
sent; the first speaking frame and every frame after it go to the session as "audio"
outputs stamped with the slot's request id and fence; `listen_after_frames` quiet frames,
or `max_response_frames` frames, end the response with a "listen" output (the plugin sets
both as times, `FrameClockedPlugin.listen_after_ms` and `max_response_ms`, counted in whole
frames of the model's period). A frame with
tool calls (`FrameOutput.function_calls`) is a speaking frame: each call follows the
frame's audio or text as a "function_call" output (before a "listen" that ends the
response). A frame's `FrameOutput.error` is sent, speaking or not, as a "nonfatal_error"
output (after its audio and calls, before its "listen"): an `error` event for the client
that fails nothing. `function_output` gives the
client's result of a call to the model (`add_function_output`, on the model thread). `abort`
interrupts the sessions it names (barge-in, cancel: `interrupt_slot`, which keeps the
model's memory) and drops whatever their step in flight made; an `ensure` with a newer
epoch re-stamps the slot.

The model's memory (a model with `state_record_bytes`): every frame's record goes to the
session's `ModelHistory` (`keep_history`), including frames whose output an abort drops
(the model stepped them). A session restored here with a history opens its slot with
`restore_slot`; the slot is not stepped while the model replays (`replay_pending`), and
the replay runs between the ticks' steps (`replay_work(slot, frames)`), scheduled by the
time it has (`_replay`, `SlotReplay.chunk`):

- the cost of a `replay_work` call is measured, per restore, as it goes, and fitted as a
  fixed part and a part per frame (`ReplayCost`: a model that replays a call's frames in
  one forward pays most of a call once, whatever its frames); a restore starts from the
  model's last fitted cost, or with one frame when none was measured;
- after each tick's step, the time until the next frame is due, less a margin
  (`REPLAY_MARGIN`), is spare (a restore that begins while the tick waits for its next
  frame starts at once, in what is left of that wait): each restore is asked for as many
  frames as one call fits in its share (the model's `replay_chunk_frames` at most a call,
  and at most twice the frames of its last call or what twice its time holds, so a cost
  measured low cannot ask for a long stall), and asked again while time is left for a call;
- several restores (a whole worker's sessions after a failover) share the spare time in
  equal shares, a different one first each tick; a restore with a short history ends first;
  where an equal share would not pay twice a call's fixed part, the restore whose turn it
  is takes the spare time, the others theirs in the next ticks; a call that took more than
  it was asked (a prompt taken whole) is left out of the cost's fit;
- whatever the spare time, at least one frame is replayed each tick (of each restore in
  turn), so every restore ends: when the live slots' steps leave no time (the machine is
  full), the replay's frame is what makes the next tick late, and the live slots give way
  by that one frame a tick (a restore must end: its session has no voice until it does).

When the slot steps again, the input that arrived meanwhile is cut to its newest
`RESTORED_INPUT_MS` (in whole frames): the model goes on in real time, not seconds behind.
A restore's progress (frames replayed of frames to replay, its pace against real time) is
`restore_progress`, and the metrics' `duplex_native_restore_*`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from services.worker.stages.slots import (
    ReplayCost,
    SlotReplay,
    SlotState,
    jitter_cap_samples,
)
from services.worker.stages.tick_clock import TickClock, TickGrid
from services.worker.stages.tick_metrics import TickMetrics
from shared.contracts import (
    DuplexFence,
    DuplexSessionError,
    FrameClockedPlugin,
    FrameModel,
    FrameOutput,
    FrameStepError,
    ImageInput,
    InputFedStagePort,
    ModelHistory,
    OutputKind,
    OutputSink,
    StageCleanupError,
    StageOutput,
    StagePlan,
    frames_in,
    parse_stage_request_id,
    stage_request_id,
)
from shared.protocol.duplex.errors import STREAM_FAILED, WORKER_LOST

log = logging.getLogger(__name__)

T = TypeVar("T")

# The stage's bounds on input are times, made whole frames of the model's period
# (`frames_in`): what a client may be ahead, or what a restored slot keeps, is a matter of
# the user's latency, whatever the model's clock (Mimi's 80 ms frames, a 1 s unit).
#: input a slot holds ahead of the clock before the oldest is cut: 2 s (25 frames at 80 ms)
MAX_BUFFERED_MS = 2000
#: what a client-clocked slot holds ahead of its model (the client's audio is its clock, so
#: nothing it sent is late, only not yet stepped): 10 s. Such a backlog is audio a client held
#: while the model stepped its prompt (LiveKit's PersonaPlex plugin sends it all after the
#: handshake, as NVIDIA's server feeds it to its model) or sent in a burst; it is stepped
#: between ticks (`_catch_up`), and beyond this the oldest is cut
CLIENT_BACKLOG_MS = 10_000
#: a client-clocked slot more than this behind its client after the catch-up steps, whose
#: backlog has not shrunk for `CLIENT_LAG_TICKS` ticks (a worker with no time to catch it
#: up), is cut back to this much: the jitter buffer's depth of the server-clocked sessions
#: (`MAX_JITTER_MS`)
CLIENT_LAG_MS = 240
#: 2 s of 80 ms ticks without a new low of the backlog: a backlog the catch-up steps are
#: draining, however slowly (a loaded worker finds time for a catch-up step every few
#: ticks only), is left to them; one that stays where it is or grows is cut
CLIENT_LAG_TICKS = 25
#: ... and never under 3 frames: after a late tick the slot holds the frame that was late
#: and the next one before the tick takes one, and the next chunk arrives meanwhile (at 1 s
#: units 2 s would cut the user's speech whenever a tick ran dry once; 3 s is held)
MIN_BUFFERED_FRAMES = 3
#: input a restored slot keeps of what arrived while it replayed: 160 ms (2 frames at
#: 80 ms, one 1 s unit), and at least what its jitter buffer holds before it takes frames
RESTORED_INPUT_MS = 160
#: the part of a frame kept free after a tick's replay: what a chunk's time may exceed its
#: estimate by before the next step starts late (measured costs drift with the history's
#: length and with the machine's other work). A share of the period, not a time: a model
#: whose step is longer varies by more (8 ms at 80 ms, 100 ms at 1 s)
REPLAY_MARGIN = 0.1
#: a tick's catch-up steps of client-clocked slots behind their client, at most (the time
#: before the next frame bounds them first: `_catch_up`)
MAX_CATCH_UP_STEPS = 8
#: the weight of a restore's newest call in the fit of its cost (`ReplayCost`): the calls
#: before it weigh 1 - this times less each (about the last five count)
REPLAY_COST_WEIGHT = 0.2


def _layout(record_bytes: int, sized: bool) -> str:
    return f"sized (up to {record_bytes} bytes)" if sized else f"{record_bytes}-byte"


@dataclasses.dataclass(frozen=True)
class RestoreProgress:
    """How far a session's restore is (`TickBatchedStagePort.restore_progress`)."""

    session_id: str
    #: frames of history to replay, and replayed so far
    frames: int
    replayed: int
    #: since the slot opened (until the replay ended, once `done`)
    seconds: float
    #: seconds of conversation replayed per second so far (x real time)
    pace: float
    done: bool

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "frames": self.frames,
            "replayed": self.replayed,
            "seconds": round(self.seconds, 3),
            "pace": round(self.pace, 2),
            "done": self.done,
        }


@dataclasses.dataclass
class TickCounters:
    """A stage's counters since start (`TickBatchedStagePort.stats`)."""

    ticks: int = 0
    deadline_misses: int = 0
    silence_frames: int = 0
    dropped_input_frames: float = 0.0
    #: camera frames passed to the model, and dropped (`SlotState.take_images`, `feed`)
    stepped_images: int = 0
    dropped_images: int = 0
    last_tick_s: float = 0.0
    max_tick_s: float = 0.0
    #: steps of client-clocked slots behind their client, between two ticks (`_catch_up`)
    catch_up_steps: int = 0
    restores: int = 0
    restored_frames: int = 0
    replay_chunks: int = 0
    #: frames replayed (restores and prompts), and the rounds (after a step, or in the
    #: wait for the next frame) that replayed any
    replayed_frames: int = 0
    replay_rounds: int = 0
    last_restore_s: float = 0.0
    #: the last restore's pace: seconds of conversation replayed per second
    last_restore_pace: float = 0.0

    def count(self, duration: float, silence: int) -> None:
        """One tick whose step took `duration` and stepped `silence` late frames."""
        self.ticks += 1
        self.silence_frames += silence
        self.last_tick_s = duration
        self.max_tick_s = max(self.max_tick_s, duration)


class TickBatchedStagePort(InputFedStagePort):
    def __init__(
        self,
        model: FrameModel,
        *,
        listen_after_frames: int | None = None,
        max_response_frames: int | None = None,
        model_name: str = "frame_model",
        metrics: TickMetrics | None = None,
        clock: TickClock | None = None,
        max_buffered_frames: int | None = None,
    ) -> None:
        """The counts in frames of `model`'s period; None: the plugin ABC's times
        (`FrameClockedPlugin.listen_after_ms`, `max_response_ms`) and `MAX_BUFFERED_MS`,
        made frames of it."""
        frame_ms = model.frame_ms
        if listen_after_frames is None:
            listen_after_frames = frames_in(FrameClockedPlugin.listen_after_ms, frame_ms)
        if max_response_frames is None:
            max_response_frames = frames_in(FrameClockedPlugin.max_response_ms, frame_ms)
        if max_buffered_frames is None:
            max_buffered_frames = max(frames_in(MAX_BUFFERED_MS, frame_ms), MIN_BUFFERED_FRAMES)
        if listen_after_frames < 1 or max_response_frames < 1 or max_buffered_frames < 1:
            raise ValueError("listen_after_frames, max_response_frames and buffers must be >= 1")
        self.model = model
        self.listen_after_frames = listen_after_frames
        self.max_response_frames = max_response_frames
        self.model_name = model_name
        self.clock = clock or TickClock()
        self.period_s = frame_ms / 1000
        self.grid = TickGrid(self.period_s)
        self.max_buffered_samples = max_buffered_frames * model.frame_samples
        #: what a client-clocked slot may lag behind its client for long (`CLIENT_LAG_MS`)
        self.client_lag_samples = max(frames_in(CLIENT_LAG_MS, frame_ms), 1) * model.frame_samples
        #: ticks a client-clocked slot may stay behind its client, draining, before it is cut
        self.backlog_ticks = max(frames_in(CLIENT_BACKLOG_MS, frame_ms), CLIENT_LAG_TICKS)
        #: the last `_tick`'s model step went through
        self._last_step_ok = True
        #: a client-clocked slot's bound (`CLIENT_BACKLOG_MS`)
        self.max_backlog_samples = (
            max(frames_in(CLIENT_BACKLOG_MS, frame_ms), max_buffered_frames) * model.frame_samples
        )
        self.max_jitter_samples = jitter_cap_samples(
            model.frame_samples, model.input_sample_rate_hz
        )
        #: frames of input a restored slot keeps (`RESTORED_INPUT_MS`)
        self.restored_input_frames = frames_in(RESTORED_INPUT_MS, frame_ms)
        images = model.image_input
        #: the most images a slot's frame carries to the model (0: it takes none)
        self.max_images = images.max_per_frame if images is not None else 0
        self._metrics = metrics
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="duplex-frame-model")
        #: each session's one record here, from its `bind` to its `cleanup`
        self._slots: dict[str, SlotState] = {}
        #: slots their sessions let go of, by index, until their `close_slot` ran (a failed
        #: one is tried again by the session's next cleanup)
        self._closing: dict[int, SlotState] = {}
        self._free = list(range(model.slots))
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        #: set when a replay starts: the tick's wait for its next frame gives it the time
        self._replay_wake = asyncio.Event()
        self._ticked = asyncio.Event()
        self.counters = TickCounters()  # since start: stats()
        #: the model's last measured cost of a replayed frame: where a restore starts
        self._replay_cost: ReplayCost | None = None
        #: which restore goes first in the next tick's replay (they take turns)
        self._replay_turn = 0
        #: releases (`cleanup`) running on: a cancelled caller does not stop its release
        self._releases: set[asyncio.Future[None]] = set()
        if metrics is not None:
            metrics.slots.labels(model_name).set(model.slots)
            metrics.slots_active.labels(model_name).set(0)

    @classmethod
    def for_plugin(
        cls,
        plugin: FrameClockedPlugin,
        model: FrameModel,
        metrics: TickMetrics | None = None,
        clock: TickClock | None = None,
    ) -> TickBatchedStagePort:
        if plugin.image_input != model.image_input:
            # the capabilities say what the plugin declares, the worker checks the model's
            raise ValueError(
                f"{plugin.plugin_id} declares image input {plugin.image_input}, "
                f"its model takes {model.image_input}"
            )
        return cls(
            model,
            listen_after_frames=frames_in(plugin.listen_after_ms, model.frame_ms),
            max_response_frames=frames_in(plugin.max_response_ms, model.frame_ms),
            model_name=plugin.plugin_id,
            metrics=metrics,
            clock=clock,
        )

    # ------------------------------------------------------------ InputFedStagePort

    def bind(self, session_id: str, sink: OutputSink) -> None:
        """The session's record here starts with its sink; its slot is taken at `ensure`."""
        slot = self._slots.get(session_id)
        if slot is None:
            slot = self._slots[session_id] = self._new_slot(session_id)
        slot.sink = sink

    def _new_slot(self, session_id: str) -> SlotState:
        return SlotState(
            None,
            session_id,
            self.model.frame_samples,
            self.max_buffered_samples,
            self.max_jitter_samples,
            self.max_images,
        )

    async def ensure(self, fence: DuplexFence, role: str) -> str:
        """A slot for the session at its first ensure; a newer epoch re-stamps it."""
        slot = self._slots.get(fence.session_id)
        if slot is None or slot.index is None:
            if not self._free:
                raise DuplexSessionError(
                    "resource_exhausted",
                    f"duplex_session_capacity_exhausted: limit={self.model.slots} "
                    f"(every slot of {self.model_name} is held)",
                )
            if slot is None:
                slot = self._slots[fence.session_id] = self._new_slot(fence.session_id)
            slot.index = self._free.pop(0)
            self._set_active_gauge()
        request_id = stage_request_id(fence, role)
        if slot.fence is None or fence.epoch > slot.fence.epoch:
            slot.fence, slot.request_id = fence, request_id
        return request_id

    async def submit_initial(self, plan: StagePlan) -> None:
        """The session's stream: open its slot in the model (`plan.payload`: its options)."""
        if (slot := self._slots.get(plan.fence.session_id)) is None or slot.index is None:
            raise DuplexSessionError("unknown_session", f"no slot for {plan.fence.session_id}")
        if plan.fence.epoch >= (slot.fence.epoch if slot.fence else 0):
            slot.fence, slot.request_id = plan.fence, plan.request_id
        options = dict(plan.payload or {})
        slot.client_clocked = plan.client_clock
        if plan.client_clock:
            slot.max_buffered_samples = self.max_backlog_samples
        if slot.opened:  # a second stream request of one session: it goes on, interrupted
            await self._on_model(self.model.interrupt_slot, slot.index)
            slot.listen()
            return
        # submitted now and shielded: a caller cancelled meanwhile (its session closed) leaves
        # the open running, and `cleanup` closes what it opened, after it on the model thread
        history = slot.history
        slot.restoring = history is not None and history.frames > 0
        if slot.restoring:
            assert history is not None
            slot.opening = asyncio.get_running_loop().run_in_executor(
                self._thread, self.model.restore_slot, slot.index, options, bytes(history.data)
            )
        else:
            slot.opening = asyncio.get_running_loop().run_in_executor(
                self._thread, self.model.open_slot, slot.index, options
            )
        await asyncio.shield(slot.opening)
        pending = await self._on_model(self.model.replay_pending, slot.index)
        if pending:
            slot.replay = SlotReplay(pending, pending, self.clock.now())
            self._replay_wake.set()
        slot.opened = slot.announce_ready = True
        self._start()
        self._wake.set()

    def feed(self, session_id: str, samples: np.ndarray, images: tuple[bytes, ...] = ()) -> None:
        """The session's converted input (mono float32 at the model's input rate), and the
        camera frames sent with it: they go to the model with the frame that holds the
        input's last sample (slots.py). The worker refused what the model does not take;
        what gets here regardless (more than it takes, an image past its size, any image
        for a model that takes none) is dropped and counted, never passed on."""
        slot = self._slots.get(session_id)
        if slot is None or slot.index is None:
            return  # closed meanwhile (or no slot yet): nothing to step it for
        dropped = slot.feed(samples)
        if dropped:
            self.counters.dropped_input_frames += dropped / self.model.frame_samples
        if images:
            spec = self.model.image_input
            fit = tuple(i for i in images if spec is not None and len(i) <= spec.max_bytes)
            self._dropped_images(len(images) - len(fit) + slot.attach(fit))

    @property
    def image_input(self) -> ImageInput | None:
        return self.model.image_input

    @property
    def state_record_bytes(self) -> int:
        return self.model.state_record_bytes

    @property
    def state_records_sized(self) -> bool:
        return self.model.state_records_sized

    def keep_history(self, session_id: str, history: ModelHistory, *, responding: bool) -> None:
        """Between the session's `ensure` and its `submit_initial`."""
        slot = self._slots.get(session_id)
        if slot is None or slot.index is None:
            raise DuplexSessionError("unknown_session", f"no slot for {session_id}")
        model = self.model
        if (history.record_bytes, history.sized) != (
            model.state_record_bytes,
            model.state_records_sized,
        ):
            raise DuplexSessionError(
                "invalid_duplex_runtime_config",
                f"the session's model history has {_layout(history.record_bytes, history.sized)}"
                f" records, {self.model_name} makes "
                f"{_layout(model.state_record_bytes, model.state_records_sized)} ones",
            )
        slot.history = history
        slot.responding = responding

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Barge-in or cancel: each named session's slot is interrupted (`interrupt_slot`:
        its output stops, its memory stays) and listens; what its step in flight made is
        dropped. Its buffered input is kept: on a barge-in that is the speech that
        interrupted the model, which it must still hear."""
        for request_id in request_ids:
            try:
                session_id, _, _ = parse_stage_request_id(request_id)
            except ValueError:
                continue
            slot = self._slots.get(session_id)
            if slot is None:
                continue
            slot.generation += 1
            slot.aborted_request_id = request_id  # silent until an ensure re-stamps it
            slot.listen()
            if slot.opened:
                await self._on_model(self.model.interrupt_slot, slot.index)

    async def function_output(self, session_id: str, call_id: str, name: str, output: str) -> None:
        """The client's result of a call the session's model made: `add_function_output` for
        its slot, on the model thread (between steps, after the slot's open)."""
        slot = self._slots.get(session_id)
        if slot is None or slot.opening is None:
            raise DuplexSessionError("unknown_session", f"no open slot for {session_id}")
        await self._on_model(self.model.add_function_output, slot.index, call_id, name, output)

    async def cleanup(self, session_id: str) -> None:
        """The session's slot is freed (its open in flight ends first, then `close_slot`).
        The release runs in a task of its own: a caller cancelled meanwhile (a timeout
        around it) is cancelled at once, as it asked, and the slot is still released."""
        slot = self._slots.pop(session_id, None)
        if slot is not None:
            slot.sink = None  # nothing reaches the session from here on
            slot.generation += 1
            slot.replay = None
            self._set_replay_gauges()
        release = asyncio.ensure_future(self._release(session_id, slot))
        self._releases.add(release)
        release.add_done_callback(self._release_done)
        await asyncio.shield(release)

    def _release_done(self, release: asyncio.Future[None]) -> None:
        self._releases.discard(release)
        if not release.cancelled() and (exc := release.exception()) is not None:
            # the caller saw it, unless it was cancelled: then this is its only trace
            log.debug("%s: a slot's release failed: %s", self.model_name, exc)

    async def _release(self, session_id: str, slot: SlotState | None) -> None:
        if slot is not None and slot.index is not None:
            if slot.opening is not None and not slot.opening.done():
                await asyncio.wait([slot.opening])  # the open in flight ends first
            if not slot.opened_in_model:
                self._free.append(slot.index)
                self._set_active_gauge()
                return
            slot.closing = True
            self._closing[slot.index] = slot
        # the session's slots still to close: this one, and one whose close failed before
        failed: StageCleanupError | None = None
        for closing in [s for s in self._closing.values() if s.session_id == session_id]:
            try:
                await self._close(closing)
            except StageCleanupError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    async def _close(self, slot: SlotState) -> None:
        """The slot's `close_slot` (one call, whoever else cleans the session up meanwhile);
        the slot is free again once it ran."""
        index = slot.index
        call = slot.close_call
        if call is None:
            call = slot.close_call = asyncio.get_running_loop().run_in_executor(
                self._thread, self.model.close_slot, index
            )
        try:
            await asyncio.shield(call)
        except Exception as exc:
            raise StageCleanupError(
                f"close_slot({index}) of {slot.session_id} failed: {exc}"
            ) from exc
        finally:
            if call.done() and slot.close_call is call:
                slot.close_call = None  # a failed one is tried again by the next cleanup
        if index is not None and self._closing.get(index) is slot:
            del self._closing[index]
            self._free.append(index)
            self._set_active_gauge()

    async def shutdown(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._on_model(self.model.close)
        self._thread.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ inspection

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def held_sessions(self) -> frozenset[str]:
        return frozenset(self._slots) | {slot.session_id for slot in self._closing.values()}

    def slot_of(self, session_id: str) -> int | None:
        slot = self._slots.get(session_id)
        return None if slot is None else slot.index

    def restore_progress(self, *, forget_done: bool = False) -> list[RestoreProgress]:
        """Each slot's restore in progress, and each restored slot's last (until its
        session ends, or once with `forget_done`: the worker's report writes a finished
        one once): frames replayed of frames to replay, seconds, pace."""
        now = self.clock.now()
        progress = []
        for slot in self._slots.values():
            replay = slot.replay or slot.replayed
            if replay is None or not slot.restoring:
                continue
            if forget_done and replay is slot.replayed:
                slot.replayed = None
            seconds = (replay.ended if replay.ended is not None else now) - replay.started
            progress.append(
                RestoreProgress(
                    slot.session_id,
                    replay.frames,
                    replay.replayed,
                    seconds,
                    self._pace(replay.replayed, seconds) if replay.replayed else 0.0,
                    replay.ended is not None,
                )
            )
        return progress

    def stats(self) -> dict[str, Any]:
        """Counters since start, for benchmarks and tests."""
        return {
            **dataclasses.asdict(self.counters),
            "frame_s": self.period_s,
            "slots": self.model.slots,
            "slots_active": sum(1 for slot in self._slots.values() if slot.opened),
            "silence_frames_by_session": {
                s.session_id: s.silence_frames for s in self._slots.values()
            },
        }

    @property
    def ticks(self) -> int:
        return self.counters.ticks

    @property
    def last_tick_s(self) -> float:
        return self.counters.last_tick_s

    async def wait_ticks(self, count: int) -> None:
        """Until `count` ticks have run since start."""
        while self.counters.ticks < count:
            await self._ticked.wait()

    # ------------------------------------------------------------ the tick

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"tick:{self.model_name}")

    async def _run(self) -> None:
        due: float | None = None
        while True:
            if not any(slot.opened for slot in self._slots.values()):
                self._wake.clear()
                await self._wake.wait()  # idle: no slot to step
                due = None
                continue
            if due is None:
                due = self.grid.first_due(self.clock.now())
            if due > self.clock.now():
                await self._wait_until(due)
                if not any(slot.opened for slot in self._slots.values()):
                    continue  # the last slot closed while the tick waited for its frame
            stepped = False
            try:
                ended = await self._tick()
                stepped = self._last_step_ok
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug of one tick must not stop the clock of every session
                log.exception("tick of %s failed", self.model_name)
                ended = self.clock.now()
            due = self._next_due(due, ended)
            try:
                # not after a failed step: the model would fail the same way, eating a frame
                # of each client's audio a time
                if stepped:
                    await self._catch_up(due)
                self._bound_client_lag()
            except asyncio.CancelledError:
                raise
            except Exception:  # the same guard: the clock goes on
                log.exception("catch-up of %s failed", self.model_name)
            await self._replay(due)

    async def _wait_until(self, due: float) -> None:
        """Until the next frame is due. A replay that starts meanwhile (a session restored
        while the tick waits) runs in the time left, not after the next step: a restore
        begins at once, and a short one is over before the next frame."""
        while (delay := due - self.clock.now()) > 0:
            if not await self.clock.sleep_unless(delay, self._replay_wake):
                return
            await self._replay(due, at_least_one=False)

    async def _replay(self, due: float, *, at_least_one: bool = True) -> None:
        """The replays' work after a tick's step (or in its wait), until the next frame is
        due (less the margin): the spare time in equal shares, a different replay first
        each time, each asked for the frames its measured cost fits in its share; after a
        step (`at_least_one`), one frame whatever the time (module head)."""
        self._replay_wake.clear()  # every replay started so far is seen here
        if not any(slot.replay is not None for slot in self._slots.values()):
            return  # the common tick: nothing to replay, no gauge to move
        margin = REPLAY_MARGIN * self.period_s
        replayed = False
        turn, self._replay_turn = self._replay_turn, self._replay_turn + 1
        progressed = False
        while True:
            queue = [slot for slot in self._slots.values() if slot.replay is not None]
            if not queue:
                break
            first = turn % len(queue)
            queue = queue[first:] + queue[:first]
            progress = False
            for position, slot in enumerate(queue):
                replay = slot.replay
                if replay is None or self._slots.get(slot.session_id) is not slot:
                    continue  # ended or closed while another replay ran
                spare = due - margin - self.clock.now()
                unknown = replay.cost is None and self._replay_cost is None
                # a probe of an unknown cost: the tick's one frame, or in the wait a frame
                # while there is time at all
                if unknown and (replayed or (not at_least_one and spare <= 0)):
                    continue
                share = spare / (len(queue) - position)
                cost = replay.cost or self._replay_cost
                if cost is not None and share < 2 * cost.fixed_s:
                    # an equal share would go mostly to calls' fixed parts (many restores
                    # after a failover): this one takes the spare, the next ones their turn
                    share = spare
                most = self.model.replay_chunk_frames
                frames = replay.chunk(share, spare, most, self._replay_cost)
                if not frames:
                    if replayed or not at_least_one:
                        continue  # no time for this one: the next tick's turn
                    frames = 1  # the tick's one frame, whatever the time
                moved = await self._replay_chunk(slot, replay, frames)
                replayed = True  # the tick's one frame was asked for, whatever came of it
                progress = progress or moved
                progressed = progressed or moved
            if not progress:
                break
        if progressed:
            self.counters.replay_rounds += 1
        self._set_replay_gauges()

    async def _replay_chunk(self, slot: SlotState, replay: SlotReplay, frames: int) -> bool:
        """One `replay_work` call of `frames` frames, timed; whether it replayed any (False
        too when it failed, and the session ends, or its slot closed meanwhile): a model
        that took none does not hold the tick in a loop."""
        started = self.clock.now()
        try:
            left = await self._on_model(self.model.replay_work, slot.index, frames)
        except Exception as exc:
            log.exception("%s: replaying session %s failed", self.model_name, slot.session_id)
            self._replay_failed(slot, f"restoring the model's state failed: {exc}")
            return False
        done = max(0, replay.left - left)
        # a call that took more than it was asked took a prompt whole (one forward of its
        # positions): it says nothing of what frames cost, and is left out of the fit
        replay.account(done, self.clock.now() - started, REPLAY_COST_WEIGHT, fitted=done <= frames)
        replay.left = left
        if replay.cost is not None:
            # the next restore starts from this fit (a copy: each restore fits its own)
            self._replay_cost = copy.copy(replay.cost)
        self.counters.replay_chunks += 1
        self.counters.replayed_frames += done
        if self._slots.get(slot.session_id) is not slot or slot.replay is not replay:
            return False  # closed while the chunk ran: its close ends the replay
        if not left:
            self._replayed(slot, replay)
        return done > 0

    def _replayed(self, slot: SlotState, replay: SlotReplay) -> None:
        """The slot is rebuilt: it steps from the next tick, on its newest input. Counted
        as a restore when it replayed a history (a prompt prefix alone, a PersonaPlex
        `.pt` voice at an open, is not one)."""
        slot.replay = None
        replay.ended = self.clock.now()
        slot.replayed = replay
        seconds = replay.ended - replay.started
        # the newest input, and at least what the jitter buffer holds before it takes frames
        keep = max(self.restored_input_frames, -(-slot.resume_at // self.model.frame_samples))
        dropped = slot.keep_latest(keep)
        if dropped:
            self.counters.dropped_input_frames += dropped / self.model.frame_samples
        if not slot.restoring:
            log.debug(
                "%s: session %s: prompt replayed in %.3f s",
                self.model_name,
                slot.session_id,
                seconds,
            )
            return
        frames = slot.history.restored_frames if slot.history is not None else 0
        pace = self._pace(replay.frames, seconds)
        counters = self.counters
        counters.restores += 1
        counters.restored_frames += frames
        counters.last_restore_s = seconds
        counters.last_restore_pace = pace
        if self._metrics is not None:
            self._metrics.restored_frames.labels(self.model_name).inc(frames)
            self._metrics.restore_duration.labels(self.model_name).observe(seconds)
            self._metrics.restore_pace.labels(self.model_name).observe(pace)
        log.info(
            "%s: session %s restored (%d frames replayed in %.3f s, %.1fx real time, "
            "%d calls, %.2f ms a frame)",
            self.model_name,
            slot.session_id,
            frames,
            seconds,
            pace,
            replay.calls,
            1000 * replay.busy_s / max(replay.frames, 1),
        )

    def _pace(self, frames: int, seconds: float) -> float:
        """Seconds of conversation replayed per second (frames of `frame_ms` each)."""
        return frames * self.period_s / seconds if seconds > 0 else float("inf")

    def _replay_failed(self, slot: SlotState, message: str) -> None:
        """A replay that raised: the slot can never step, so the session ends (its stream
        reads this `WORKER_LOST` error with no response as the end: native_stream.py);
        the slot is freed by its cleanup."""
        slot.replay = None
        slot.opened = False  # never stepped again
        sink = slot.sink
        if sink is not None and slot.request_id and slot.fence:
            sink(
                StageOutput(
                    slot.request_id,
                    slot.fence,
                    OutputKind.ERROR,
                    error_code=WORKER_LOST,  # its slot could not be rebuilt
                    message=message,
                )
            )

    def _next_due(self, due: float, ended: float) -> float:
        """The grid's next due time; a miss is counted."""
        next_due, missed = self.grid.next_due(due, ended)
        if missed:
            self.counters.deadline_misses += 1
            if self._metrics is not None:
                self._metrics.deadline_misses.labels(self.model_name).inc()
        return next_due

    async def _catch_up(self, due: float) -> None:
        """Client-clocked slots behind their client (a whole frame of input left after the
        tick's step: early audio, a burst, a worker that fell behind) step again, those slots
        alone, while the time before the next frame holds a step (the last one's duration,
        plus the margin), `MAX_CATCH_UP_STEPS` at most: such a slot's backlog drains as fast
        as the worker has time, as the reference server steps a frame as soon as it is whole,
        and it is never more than `CLIENT_BACKLOG_MS` (the input bound cuts the oldest)."""
        margin = REPLAY_MARGIN * self.period_s
        for _ in range(MAX_CATCH_UP_STEPS):
            behind = [
                slot
                for slot in self._slots.values()
                if slot.opened and not slot.replaying and not slot.closing and slot.behind
            ]
            if not behind or due - margin - self.clock.now() <= self.counters.last_tick_s:
                return
            await self._tick(behind)
            if not self._last_step_ok:
                return
            self.counters.catch_up_steps += 1
            if self._metrics is not None:
                self._metrics.catch_up_steps.labels(self.model_name).inc()

    def _bound_client_lag(self) -> None:
        """A client-clocked slot still more than `CLIENT_LAG_MS` behind its client after the
        catch-up steps, whose backlog reached no new low for `CLIENT_LAG_TICKS` ticks, is one
        the worker has no time to catch up (its steps take most of the frame): its input is
        cut to its newest `CLIENT_LAG_MS` (counted as dropped input) so that the model
        answers its user that late at most, not seconds late for the rest of the session.
        A backlog that keeps shrinking is draining, at whatever pace the worker's load
        allows, and is left to the catch-up steps (cutting it would lose what the client
        sent, audio held while the prompt was stepped, only because the machine is slow),
        for as long as a whole backlog lasts at most (`CLIENT_BACKLOG_MS` of ticks): a drain
        too slow to end in that time is cut as well."""
        for slot in self._slots.values():
            if not slot.client_clocked:
                continue
            if slot.announce_ready or slot.replaying or slot.buffered <= self.client_lag_samples:
                slot.lagging_ticks = slot.behind_ticks = 0
                slot.lag_low = None
                continue
            slot.behind_ticks += 1
            if slot.lag_low is None or slot.buffered < slot.lag_low:
                slot.lag_low = slot.buffered  # behind, but less than ever: draining
                slot.lagging_ticks = 0
            else:
                slot.lagging_ticks += 1
            # no new low for CLIENT_LAG_TICKS, or behind for as long as a whole backlog
            # lasts (a drain too slow to end in that time keeps its user that late)
            if slot.lagging_ticks >= CLIENT_LAG_TICKS or slot.behind_ticks >= self.backlog_ticks:
                dropped = slot.keep_latest(self.client_lag_samples // self.model.frame_samples)
                self.counters.dropped_input_frames += dropped / self.model.frame_samples
                slot.lagging_ticks = slot.behind_ticks = 0
                slot.lag_low = None

    async def _tick(self, only: Sequence[SlotState] | None = None) -> float:
        """One batched step of every open slot (`only`: of these alone, a catch-up);
        `_last_step_ok` says whether the model's step went through."""
        model = self.model
        frames = np.zeros((model.slots, model.frame_samples), np.float32)
        active = np.zeros(model.slots, bool)
        images: list[tuple[bytes, ...]] = [()] * model.slots
        stepped: list[tuple[SlotState, int]] = []
        silence = 0
        for slot in list(self._slots.values()) if only is None else only:
            if not slot.opened or slot.replaying:
                continue
            if (
                slot.client_clocked
                and slot.announce_ready
                and not model.prompt_frames_left(slot.index)
            ):
                self._ready(slot)  # nothing of its own to step before its client speaks
            if slot.waits_for_input:
                continue  # its client's audio is its clock, and has not ticked: state kept
            active[slot.index] = True
            if not slot.take_frame(frames[slot.index]):
                silence += 1  # its images wait for their audio
            elif slot.images:
                images[slot.index], dropped = slot.take_images()
                self.counters.stepped_images += len(images[slot.index])
                self._dropped_images(dropped)
            stepped.append((slot, slot.generation))
            if self._metrics is not None:
                lag = slot.buffered / model.input_sample_rate_hz
                self._metrics.input_lag.labels(self.model_name).observe(lag)
        started = self.clock.now()
        records: list[bytes | None] = [None] * model.slots
        self._last_step_ok = False
        try:
            seen = images if any(images) else None  # None: no image this step (the common one)
            outputs = await self._on_model(model.step, frames, active, seen)
            records = [o.record if o is not None else None for o in outputs]
            self._last_step_ok = True
        except Exception as exc:
            log.exception("%s: model step failed", self.model_name)
            outputs = [None] * model.slots
            if isinstance(exc, FrameStepError):
                records = exc.records  # the model advanced all the same: its frames count
            self._fail(stepped, f"model step failed: {exc}")
        ended = self.clock.now()
        self._count(ended - started, silence)
        for slot, generation in stepped:
            record, history = records[slot.index], slot.history
            # a sized record may be empty and is a frame all the same
            kept = record is not None and (bool(record) or (history is not None and history.sized))
            if kept and history is not None and self._slots.get(slot.session_id) is slot:
                # the model stepped it: its memory holds this frame, aborted or not
                history.append(record)
            if slot.announce_ready and not self.model.prompt_frames_left(slot.index):
                self._ready(slot)
            output = outputs[slot.index]
            if output is None:
                continue
            # aborted or closed while the step ran: nothing it made for this slot is sent
            if generation == slot.generation:
                self._fan_out(slot, output)
        return ended

    def _dropped_images(self, count: int) -> None:
        if count:
            self.counters.dropped_images += count
            if self._metrics is not None:
                self._metrics.dropped_images.labels(self.model_name).inc(count)

    def _ready(self, slot: SlotState) -> None:
        """The slot has stepped its prompt: its session hears the next frame's input."""
        slot.announce_ready = False
        sink = slot.sink
        if sink is not None and slot.request_id is not None and slot.fence is not None:
            sink(StageOutput(slot.request_id, slot.fence, OutputKind.READY))

    def _count(self, duration: float, silence: int) -> None:
        self.counters.count(duration, silence)
        if self._metrics is not None:
            self._metrics.duration.labels(self.model_name).observe(duration)
            if silence:
                self._metrics.silence_frames.labels(self.model_name).inc(silence)
        ticked, self._ticked = self._ticked, asyncio.Event()
        ticked.set()

    def _fan_out(self, slot: SlotState, output: FrameOutput) -> None:
        calls = tuple(output.function_calls or ())
        # a frame that calls a tool is speech: it opens a response if none is open
        speaking = bool(output.speaking) or bool(calls)
        send, ends = slot.on_frame(speaking, self.listen_after_frames, self.max_response_frames)
        sink = slot.sink
        if sink is None or slot.request_id is None or slot.fence is None:
            return
        if slot.request_id == slot.aborted_request_id:
            return  # nothing of an aborted request is sent (the runner re-stamps at once)
        if not send:
            if slot.client_clocked:  # its protocol sends every frame, the model's quiet too
                rate = self.model.output_sample_rate_hz
                audio = np.array(output.audio, dtype=np.float32).reshape(-1)
                if audio.size:  # none yet: the model's acoustic delay, nothing to send
                    sink(StageOutput(slot.request_id, slot.fence, OutputKind.QUIET, audio, rate))
            self._frame_error(sink, slot, output)  # the frame's own error, speaking or not
            return
        # a copy: a model may reuse its output buffer at the next step, before the runner
        # has encoded this frame
        audio = np.array(output.audio, dtype=np.float32).reshape(-1)
        if audio.size:
            rate = self.model.output_sample_rate_hz
            sink(
                StageOutput(slot.request_id, slot.fence, OutputKind.AUDIO, audio, rate, output.text)
            )
        elif output.text:  # words in a frame without sound yet (a model's acoustic delay)
            sink(StageOutput(slot.request_id, slot.fence, OutputKind.TEXT, text=output.text))
        for call in calls:  # held on the response until it completes (tool_calls.py)
            sink(
                StageOutput(
                    slot.request_id, slot.fence, OutputKind.FUNCTION_CALL, function_call=call
                )
            )
        self._frame_error(sink, slot, output)
        if ends:
            sink(StageOutput(slot.request_id, slot.fence, OutputKind.LISTEN))

    def _frame_error(self, sink: OutputSink, slot: SlotState, output: FrameOutput) -> None:
        """The frame's non-fatal error (`FrameOutput.error`), if any: an error event for the
        session that fails nothing (after the frame's audio and calls, before its listen)."""
        if output.error is None or slot.request_id is None or slot.fence is None:
            return
        code, message = output.error
        sink(
            StageOutput(
                slot.request_id,
                slot.fence,
                OutputKind.NONFATAL_ERROR,
                error_code=str(code),
                message=str(message),
            )
        )

    def _fail(self, stepped: list[tuple[SlotState, int]], message: str) -> None:
        """A failed step fails the responses in progress; the slots listen again."""
        for slot, _ in stepped:
            sink = slot.sink
            if slot.responding and sink is not None and slot.request_id and slot.fence:
                sink(
                    StageOutput(
                        slot.request_id,
                        slot.fence,
                        OutputKind.ERROR,
                        error_code=STREAM_FAILED,  # a model step that raised
                        message=message,
                    )
                )
            slot.listen()

    # ------------------------------------------------------------ helpers

    def _set_replay_gauges(self) -> None:
        if self._metrics is not None:
            replays = [slot.replay for slot in self._slots.values() if slot.replay is not None]
            self._metrics.restores_in_progress.labels(self.model_name).set(len(replays))
            left = sum(replay.left for replay in replays)
            self._metrics.replay_frames_left.labels(self.model_name).set(left)

    def _set_active_gauge(self) -> None:
        if self._metrics is not None:
            held = self.model.slots - len(self._free)
            self._metrics.slots_active.labels(self.model_name).set(held)

    async def _on_model(self, method: Callable[..., T], *args: Any) -> T:
        """`method` on the model thread (never two at once, in call order)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, method, *args)
