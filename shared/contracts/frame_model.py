"""`FrameModel` and `FrameClockedPlugin`: native full-duplex models, stepped per frame.

A native full-duplex model (Moshi, PersonaPlex) hears and speaks on every audio frame
(80 ms for Mimi at 12.5 Hz; a frame is the model's own: MiniCPM-o steps once per 1 s unit,
and sees the camera frames sent with it). Serving many sessions of one is not one runner
per request: the worker's tick-batched stage (`services/worker/stages/tick_batched.py`)
runs ONE batched model step per frame for every session on the worker. Each session holds a
slot (a row of the batch) from open to close; a frame whose input has not arrived is
stepped on silence, so the clock never waits for a slow client.

The plugin provides the model behind this ABC and never sees the clock, the slots'
owners or the sessions: `step` gets a batch of input frames and returns one output per
slot. Every method of a `FrameModel` is blocking and runs on the stage's one model
thread (never on the event loop, never two at once), so a model needs no lock.

A model that sees (`image_input`) gets each slot's camera frames with the frame of audio
they were sent with (`step`'s `images`: the encoded JPEG or PNG bytes, which the worker has
checked for count, size and format but not decoded; `shared/contracts/images.py`).

Turn taking is the model's: each output frame says whether the model speaks in it
(`FrameOutput.speaking`). The stage turns runs of speaking frames into responses and a
run of quiet frames back into listening; barge-in and cancel interrupt one slot
(`interrupt_slot`: its output stops, its memory stays), never the batch.

The model's memory moves with its session. A model with `state_record_bytes` > 0 gives,
with every output, the frame's state record (`FrameOutput.record`): what the step fed into
the model, such that the slot's state after N steps is a pure function of the options it
was opened with and its N records, in the model's layout (the session's *history*: every
record alike and concatenated, or, `state_records_sized`, each of its own size after its
length; shared/contracts/model_history.py). The worker writes the history to Redis as it
grows (append-only), and a session moved to another worker gets its slot back by
`restore_slot`: the model replays the history in chunks
(`replay_work(slot, frames)`, one call at a time between steps). The stage, not the model,
sizes each chunk: it measures what a replayed frame costs (per restore, as it goes) and
asks for as many frames as fit in the tick's spare time (`replay_chunk_frames` at most a
call, at least one frame a tick), so the other slots never wait for it; the slot is
stepped again once its replay is done.

A model may call the session's tools (the client's function tools: a plugin puts what its
model needs of them in the options `open_slot` gets, from `prepare_runtime_config`). A
frame's `FrameOutput.function_calls` are the complete calls the model made in it: such a
frame counts as speaking, and its calls are held on its response and sent to the client as
function_call items when the response completes (dropped if it is cancelled first). The
client's result of a call reaches the model by `add_function_output` (on the model thread,
between steps), which takes it into the slot's memory; the model then speaks when it will
(a model-native session never takes `response.create`). A frame's `FrameOutput.error` is a
non-fatal error of that frame for its slot (a tool call the model wrote that does not
parse): the client gets it as an `error` event, and neither the response nor the session
ends.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from shared.contracts.config import DuplexCapabilities, SessionRuntimeConfig
from shared.contracts.images import ImageInput
from shared.contracts.plugin import (
    DuplexModelPlugin,
    DuplexRuntimeConfigError,
    ResponsePlanRequest,
)
from shared.contracts.stages import FunctionCall, StagePlan, StagePort


@dataclasses.dataclass
class FrameOutput:
    """What one slot's model step produced."""

    #: one frame of the model's voice, mono float32 at the model's output rate (empty
    #: while the model has produced no audio yet, e.g. during its acoustic delay)
    audio: np.ndarray
    #: the words this frame adds to what the model says ("" for none)
    text: str = ""
    #: the model speaks in this frame (model-native turn taking)
    speaking: bool = False
    #: the frame's state record (`FrameModel.state_record_bytes` bytes, or at most that many
    #: where the model's records are sized; b"" for a model whose state does not move)
    record: bytes = b""
    #: the complete tool calls the model made in this frame (a frame with calls counts as
    #: speaking: it opens a response if none is open)
    function_calls: tuple[FunctionCall, ...] = ()
    #: (code, message) of a non-fatal error of this frame for this slot (e.g. a tool call
    #: that does not parse): an `error` event to the client; the response and the session go on
    error: tuple[str, str] | None = None


class FrameStepError(RuntimeError):
    """A step that failed after the model's state had advanced: `records` are the frame's
    records of the slots it stepped (None for the others), which still go to their
    histories, so a history never lacks a frame its model holds."""

    def __init__(self, message: str, records: list[bytes | None]) -> None:
        super().__init__(message)
        self.records = records


class FrameModel(abc.ABC):
    """A frame-clocked model with `slots` sessions stepped in one batch.

    Slots are numbered 0..slots-1. A slot is opened (or restored) before its first
    step, interrupted on a barge-in or cancel, and closed when its session ends (and may
    then be opened again, for another session, as a fresh conversation); a slot stepped
    as inactive (`active[slot]` False: closed, replaying, or open and waiting for its
    client's audio, `StagePlan.client_clock`) keeps its state, and changes no one else's
    output: a session's outputs are the same whoever shares the batch.
    """

    #: samples of one input frame at `input_sample_rate_hz`
    frame_samples: int
    input_sample_rate_hz: int
    output_sample_rate_hz: int
    #: sessions one batched step serves
    slots: int
    #: bytes of one frame's state record (the most one holds where they are sized); 0: the
    #: model's state cannot be exported (a restored session opens a fresh slot)
    state_record_bytes: int = 0
    #: its records have sizes of their own (a 1 s unit's tokens and camera frames vary):
    #: its history length-prefixes each (the "sized" layout, model_history.py); False:
    #: every record is `state_record_bytes` long, concatenated (the "fixed" layout)
    state_records_sized: bool = False
    #: the camera frames a step takes with its audio (`step`'s `images`); None: audio only
    #: (the stage never passes it an image: the worker refuses video to it)
    image_input: ImageInput | None = None
    #: the most frames one `replay_work` call may be asked for (what the model's replay
    #: buffers are sized for: Moshi's side ring holds its context plus this many); the stage
    #: asks for fewer whenever the tick's spare time holds fewer, and calls again while it
    #: has time, so a wrong guess here costs calls, never a wait or a deadline
    replay_chunk_frames: int = 16

    @property
    def frame_ms(self) -> float:
        """The model's clock: one step every `frame_ms`."""
        return self.frame_samples * 1000 / self.input_sample_rate_hz

    @abc.abstractmethod
    def open_slot(self, slot: int, options: Mapping[str, Any]) -> None:
        """A fresh conversation in `slot`. `options` is the session's runtime config as
        the plugin prepared it (`prepare_runtime_config`: a persona, a voice prompt)."""

    @abc.abstractmethod
    def interrupt_slot(self, slot: int) -> None:
        """Barge-in or cancel (and a second stream request of one session): the slot's
        current output stops, and it keeps its memory of the conversation so far, which
        its next records say, so a restore interrupts where it did; every other slot is
        untouched."""

    def restore_slot(self, slot: int, options: Mapping[str, Any], history: bytes) -> None:
        """Open `slot` as the session whose history (its frames' records in the model's
        layout: concatenated, or each after its length where they are sized;
        `split_records` reads them) is `history`: what `open_slot` does, then the history
        replayed. Only a model with `state_record_bytes` > 0 implements it."""
        raise NotImplementedError(f"{type(self).__name__} cannot restore a slot's state")

    def replay_pending(self, slot: int) -> int:
        """Frames the slot still has to replay (a restore's history, a prompt given as
        precomputed model inputs) before it can be stepped; 0: it steps. A step with a
        replaying slot active raises."""
        return 0

    def replay_work(self, slot: int, frames: int) -> int:
        """Replay the slot's next `frames` pending frames (1 <= `frames` <=
        `replay_chunk_frames`; all that are left when fewer are), between steps; returns
        the frames left, 0 once the slot is as it was when its last record was made.

        The stage times each call and divides by the frames it took off `replay_pending`:
        that is the cost per frame it sizes the next chunks by, so a call does the work of
        the frames it replays and no more (a model whose prompt is one piece of work, a
        prompt run in one forward, may take more than `frames` of it in one call)."""
        raise NotImplementedError(f"{type(self).__name__} has nothing to replay")

    def prompt_frames_left(self, slot: int) -> int:
        """Frames of the slot's prompt (a persona, a voice prompt) still to step before its
        conversation starts; 0: it hears the session from the next step. The stage tells
        the session once it is 0 (`StageOutput` "ready": Moshi's handshake)."""
        return 0

    def add_function_output(self, slot: int, call_id: str, name: str, output: str) -> None:
        """The client's result (`output`) of the call `call_id` of tool `name` that `slot`
        made: the model takes it into the slot's memory (how is the model's business), and
        speaks about it when it will. Only a model that makes `FrameOutput.function_calls`
        implements it."""
        raise NotImplementedError(f"{type(self).__name__} makes no function calls")

    @abc.abstractmethod
    def close_slot(self, slot: int) -> None:
        """The session of `slot` ended: the slot is free for another."""

    def checked_active(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> np.ndarray:
        """`active` as bool [slots], once `frames`, `active` (and `images`, given) have the
        step's shapes (ValueError otherwise): what every `step` checks first."""
        active = np.asarray(active, dtype=bool)
        if frames.shape != (self.slots, self.frame_samples) or active.shape != (self.slots,):
            raise ValueError(
                f"step wants frames [{self.slots}, {self.frame_samples}] and active "
                f"[{self.slots}], got {frames.shape} and {active.shape}"
            )
        if images is not None:
            if self.image_input is None:
                raise ValueError(f"{type(self).__name__} takes no images")
            if len(images) != self.slots:
                raise ValueError(f"step wants images for {self.slots} slots, got {len(images)}")
        return active

    @abc.abstractmethod
    def step(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> list[FrameOutput | None]:
        """One batched step. `frames`: float32 [slots, frame_samples] (zeros where the
        input was late or the slot is inactive); `active`: bool [slots]. Returns one
        output per slot, None for the inactive ones.

        `images`: the camera frames of this step, for a model with `image_input`: one
        tuple per slot, of the encoded images (JPEG or PNG, as the client sent them)
        attached to this frame of its input, oldest first; () where none (and for a slot
        stepped on silence: an image waits for the audio it was sent with). At most
        `image_input.max_per_frame` a slot, each at most `max_bytes`, not decoded: an image
        the model cannot decode is its frame's `FrameOutput.error` (`invalid_video_frames`),
        and the slot steps on without it. None: no slot has an image this step (always,
        for a model without `image_input`)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the model's resources when the worker stops."""


def frames_in(ms: float, frame_ms: float) -> int:
    """The whole frames of `frame_ms` that last at least `ms` (at least one): how a time
    set in ms (`FrameClockedPlugin.listen_after_ms`, the stage's bounds) becomes a count of
    the model's frames."""
    # a hair under: 480 ms / 80 ms is 6 frames, not 7 for a float's last bit
    return max(1, math.ceil(ms / frame_ms - 1e-9))


class FrameClockedPlugin(DuplexModelPlugin):
    """A plugin whose model is a `FrameModel`: the worker serves it with its
    tick-batched stage, not a stage port of the plugin's own, and the model, not a
    committed turn, starts every response (`plan_response` is never called)."""

    # Times, not frame counts: the stage counts whole frames of the loaded model's own
    # period (`frames_in`), so a model of any clock gets the same pause and cap: 6 and 750
    # of Mimi's 80 ms frames, 1 and 60 of a 1 s unit.
    #: how long a speaking model is quiet before it is listening again (its response
    #: ends): 480 ms, at least one frame
    listen_after_ms: ClassVar[float] = 480
    #: a response longer than this ends, and the next speaking frame opens another (a
    #: model that never stops would otherwise hold one response forever): 60 s
    max_response_ms: ClassVar[float] = 60_000
    #: the model's frame in ms, for the capabilities (`chunk_period_ms`) before the model
    #: is loaded; the stage's clock is the loaded model's own `FrameModel.frame_ms`
    frame_period_ms: ClassVar[int] = 80
    #: the camera frames the model takes, for the capabilities before it is loaded: its
    #: `FrameModel.image_input`, the same (the worker checks them at start)
    image_input: ClassVar[ImageInput | None] = None

    def capabilities(self, max_sessions: int) -> DuplexCapabilities:
        """A model-native, full-duplex model: it decides when it speaks; barge-in and
        cancel interrupt its slot; a session restored elsewhere gets its model's memory
        back where the model exports its state (`FrameModel.state_record_bytes`), and
        opens a fresh slot where it does not. Video is an input only of a model that takes
        images (`image_input`): to any other the worker refuses it."""
        return DuplexCapabilities(
            supports_model_native_turn_policy=True,
            supports_barge_in=True,
            supports_playback_ack=True,
            supports_session_lease=True,
            supports_session_resume=True,
            supports_model_internal_state=True,
            supports_realtime_endpoint=True,
            supports_independent_io_streams=True,
            supports_multi_session=max_sessions > 1,
            supports_multi_session_same_replica=max_sessions > 1,
            session_admission_mode="engine_managed",
            chunk_period_ms=self.frame_period_ms,
            target_barge_in_latency_ms=self.frame_period_ms,
            supports_image_input=self.image_input is not None,
            optional_input_modalities=("video",) if self.image_input is not None else (),
        )

    def validate_client_extra_body(self, extra_body: Mapping[str, Any]) -> None:
        """`auto_response: false` (a turn-based session) is refused: the model, not a
        committed turn, starts every response. Overrides call this."""
        super().validate_client_extra_body(extra_body)
        if extra_body.get("auto_response", True) is False:
            raise DuplexRuntimeConfigError(
                "invalid_duplex_runtime_config",
                f"{self.plugin_id} is model-native: it decides itself when it speaks, "
                "so extra_body.auto_response cannot be false",
                param="extra_body.auto_response",
            )

    @abc.abstractmethod
    def frame_model(self, max_sessions: int) -> FrameModel:
        """Build (load) the model with at most `max_sessions` slots. Called once per
        worker process; blocking (it loads weights)."""

    def create_stage_port(self, runtime: SessionRuntimeConfig) -> StagePort:
        raise TypeError(
            f"{self.plugin_id} is frame-clocked: the worker serves it with its tick-batched "
            "stage (services/worker/stages/tick_batched.py)"
        )

    def plan_response(self, request: ResponsePlanRequest) -> StagePlan:
        raise TypeError(f"{self.plugin_id} decides itself when it speaks: nothing to plan")


__all__ = ["FrameClockedPlugin", "FrameModel", "FrameOutput", "FrameStepError", "frames_in"]
