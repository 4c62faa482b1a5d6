"""`NativeStream`: a session of a frame-clocked plugin is one model-native stream.

A native full-duplex model hears every frame and decides itself when it speaks
(`shared/contracts/frame_model.py`). Its session holds a slot of the worker's tick-batched
stage (`services/worker/stages/tick_batched.py`) for its whole life, and one long-lived
stream request on it:

- at start (open and restore) the stream is ensured and submitted on the runner's task,
  with the session's runtime config as its payload: the slot opens in the model. The
  model's memory moves with the session where the model exports it (a stage whose
  `state_record_bytes` > 0): the stream owns the session's `ModelHistory`, which the stage
  appends every frame's record to and the publisher writes to Redis as it grows; a
  restore (drain, failover, same-id restart) comes with the history read back, and the
  slot is rebuilt from it before it steps again. The open does not wait for the slot (the
  worker dispatches every session's commands on one task, and the model thread may be
  mid-step), so a stream that cannot start ends the session afterwards: its error, then
  session.closed; a session that never speaks must not hold a slot. What a plugin can
  check without its model (a PersonaPlex voice file) it refuses at the open itself;
- every converted append is fed to the slot as the runner applies it (`feed`: the stage
  is an `InputFedStagePort`), so input reaches the model in order and an input.cancel's
  dropped appends never reach it; an append's camera frames (`video_frames`) go with it,
  checked at its dispatch against what the model takes (`camera_frames`,
  video_frames.py: refused with `invalid_video_frames` otherwise, the session goes on) and
  handed to the model with the frame of audio the append's last sample lands in;
- the stage's frames open responses: an "audio" (or "text") output with no active
  response opens one on the current epoch (`opens`), later frames are its deltas, and a
  "listen" output completes it (`ResponseController.on_stage_output`);
- user speech over a response is reported (`overlap.decision`, action "listen", reason
  "model_native") and never cancels it: the model hears the overlap and decides;
- an epoch advance (barge_in, response.cancel, output_audio_buffer.clear, input.cancel)
  aborts the response's stream request (the stage resets this one slot) and `restamp`s the
  stream under the new fence, so the model's next speech opens a new response;
- response.create is refused (`unsupported_native_response_options`) and a commit never
  plans a response: the user's turn item is committed, and the model answers when it will.
- tool calls: the stage's "function_call" outputs open a response as speech does and are
  held on it (tool_calls.py), emitted as function_call items when it completes and dropped
  when it is cancelled; a client's `function_call_output` item goes into history and then
  to the model (`function_output`), which speaks about it when it will (response.create
  stays refused).

The session's own input ledger is what a client's commit takes as the user's item; a
stream that is never committed would grow it without bound (and run into the session's
input budget), so `feed` keeps only the latest `TURN_WINDOW_MS` of it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from services.worker.engine.engine_session import EngineSession
from services.worker.engine.native_surfaces import SurfaceBytes, client_clocked
from services.worker.engine.video_frames import camera_frames
from shared.contracts import (
    SIZED_RECORDS,
    DuplexModelPlugin,
    DuplexRuntimeConfigError,
    DuplexSessionError,
    FrameClockedPlugin,
    InputFedStagePort,
    ModelHistory,
    StageOutput,
    StagePlan,
    StagePort,
)
from shared.protocol.duplex import MOSHI_AUDIO, OutputAudioEncoder
from shared.protocol.duplex.errors import INPUT_FAILED, STREAM_FAILED, WORKER_LOST

log = logging.getLogger(__name__)

#: the user audio a model-native session keeps for a client's commit (its latest 30 s)
TURN_WINDOW_MS = 30_000
#: trimmed when it is this much over the window (not at every append: a trim copies)
TRIM_SLACK_MS = 10_000


@dataclasses.dataclass(frozen=True)
class OpenStream:
    """The runner's first mailbox item in a model-native session: start the stream."""


def is_native_stream(plugin: DuplexModelPlugin) -> bool:
    return isinstance(plugin, FrameClockedPlugin)


class NativeStream:
    def __init__(self, session: EngineSession, plugin: DuplexModelPlugin, port: StagePort) -> None:
        self.session = session
        self.plugin = plugin
        self.port = port
        self.role = plugin.stage_roles[0]
        self.request_id: str | None = None
        #: the model's memory of the session (None: the stage's model exports none)
        self.history: ModelHistory | None = None
        if isinstance(port, InputFedStagePort) and port.state_record_bytes:
            self.history = ModelHistory(port.state_record_bytes, sized=port.state_records_sized)
        #: a response was in flight when the session moved here: the model goes on with it
        self.responding = False
        #: encodes the quiet frames of a client-clocked session (`quiet_frame`)
        self._quiet_encoder: OutputAudioEncoder | None = None

    def restored_history(self, data: bytes, record_bytes: int | None = None) -> None:
        """A restore: the history written to Redis so far (what the model replays), in the
        layout its writer said (`record_bytes`: the session hash's `model_record_bytes`,
        every record's size or `SIZED_RECORDS` for sized ones; None: this model's). A
        history of another layout or record size (written by a worker of another version)
        or not of whole records is refused (`invalid_duplex_runtime_config`: the move is
        refused, the session closes), never replayed misaligned."""
        if self.history is None:
            return
        mine = self.history
        if record_bytes is not None and record_bytes != mine.meta_record_bytes:
            raise DuplexSessionError(
                "invalid_duplex_runtime_config",
                f"the session's model history has {_layout(record_bytes)} records, this "
                f"worker's {self.plugin.plugin_id} makes {_layout(mine.meta_record_bytes)} ones",
            )
        try:
            self.history = ModelHistory(mine.record_bytes, data, sized=mine.sized)
        except ValueError as exc:
            raise DuplexSessionError(
                "invalid_duplex_runtime_config",
                f"the session's model history ({len(data)} bytes) is not whole records: {exc}",
            ) from None

    async def open(self) -> None:
        """Ensure and submit the stream under the session's fence (the slot opens)."""
        session = self.session
        try:
            request_id = await self.port.ensure(session.fence, self.role)
            if self.history is not None and isinstance(self.port, InputFedStagePort):
                self.port.keep_history(session.session_id, self.history, responding=self.responding)
            plan = StagePlan(
                request_id,
                session.fence,
                self.role,
                dict(session.runtime_config),
                client_clock=client_clocked(session),
            )
            await self.port.submit_initial(plan)
        except DuplexSessionError:
            raise
        except DuplexRuntimeConfigError as exc:  # what the model refused at its open (a voice)
            raise DuplexSessionError(exc.code, exc.message, param=exc.param) from None
        except Exception as exc:
            log.exception("session %s: the model stream did not start", session.session_id)
            message = f"the model stream did not start: {exc}"
            raise DuplexSessionError(STREAM_FAILED, message) from exc
        self.request_id = request_id

    async def restamp(self) -> None:
        """After an epoch advance: the stream goes on under the new fence."""
        self.request_id = await self.port.ensure(self.session.fence, self.role)

    def camera_frames(self, frames: Sequence[str]) -> tuple[bytes, ...]:
        """An append's `video_frames`, checked against what the stage's model takes (at
        the append's dispatch): the images to `feed` with its audio, or
        `invalid_video_frames` (video_frames.py)."""
        port = self.port
        spec = port.image_input if isinstance(port, InputFedStagePort) else None
        return camera_frames(frames, spec)

    def feed(self, samples: np.ndarray, images: tuple[bytes, ...] = ()) -> None:
        """An applied append (and its camera frames, `camera_frames`): to the model's slot,
        and the ledger kept within its window."""
        if isinstance(self.port, InputFedStagePort):
            self.port.feed(self.session.session_id, samples, images)
        ledger = self.session.input
        # the stream's input is never replayed into a model (its memory moves as the
        # model's history): a checkpoint's `applied` must not go back to the stream's first
        # append (before_turn)
        ledger.first_mark = None
        if ledger.samples * 1000 > (TURN_WINDOW_MS + TRIM_SLACK_MS) * ledger.sample_rate_hz:
            ledger.trim_before(ledger.stream_ms - TURN_WINDOW_MS)

    async def function_output(self, call_id: str, name: str, output: str) -> None:
        """The client's `function_call_output` of a call the model made: to the model of
        the session's slot (`InputFedStagePort.function_output`). A stage or model that
        cannot take it raises `runtime_input_failed` (the command's error event); the output
        stays in history."""
        port, session_id = self.port, self.session.session_id
        try:
            if not isinstance(port, InputFedStagePort):
                raise NotImplementedError(f"{type(port).__name__} takes no function outputs")
            await port.function_output(session_id, call_id, name, output)
        except DuplexSessionError:
            raise
        except NotImplementedError as exc:
            raise DuplexSessionError(
                INPUT_FAILED, f"the model takes no function outputs: {exc}"
            ) from None
        except Exception as exc:
            log.exception("session %s: the model did not take a function output", session_id)
            raise DuplexSessionError(
                INPUT_FAILED, f"the model did not take the function output: {exc}"
            ) from exc

    def quiet_frame(self, output: StageOutput) -> SurfaceBytes:
        """A frame the model stepped while listening, in a client-clocked session (its
        protocol sends every frame): its audio in the session's output format, as a
        response's frames cross Redis (`MOSHI_AUDIO`: the bytes, no JSON)."""
        if self._quiet_encoder is None:
            fmt = self.session.config.output_audio_format
            self._quiet_encoder = OutputAudioEncoder(fmt, self.plugin.output_sample_rate_hz)
        audio = output.audio if output.audio is not None else np.zeros(0, np.float32)
        return SurfaceBytes(type_name=MOSHI_AUDIO, data=self._quiet_encoder.encode(audio))

    def owns(self, output: StageOutput) -> bool:
        """Whether a stage output is of this session's stream (any epoch)."""
        fence = output.fence
        return fence is not None and fence.session_id == self.session.session_id

    def lost(self, output: StageOutput) -> bool:
        """Whether a stage output says the stream is gone for good: the slot's restore
        failed (`WORKER_LOST`), for this session."""
        fence = output.fence
        return (
            output.kind == "error"
            and output.error_code == WORKER_LOST
            and fence is not None
            and fence.session_id == self.session.session_id
        )

    def opens(self, output: StageOutput) -> bool:
        """Whether a stage output with no active response opens one: the model's speech
        (or a tool call it makes), stamped with the session's current epoch (an older
        one's is stale)."""
        fence = output.fence
        return (
            output.kind in ("audio", "text", "function_call")
            and fence is not None
            and fence.session_id == self.session.session_id
            and fence.epoch == self.session.epoch
        )


def _layout(meta_record_bytes: int) -> str:
    """A history's layout as the session hash's `model_record_bytes` says it, in words."""
    return "sized" if meta_record_bytes == SIZED_RECORDS else f"{meta_record_bytes}-byte"


def refuse_response_create() -> DuplexSessionError:
    return DuplexSessionError(
        "unsupported_native_response_options",
        "response.create is not taken in a model-native session: the model decides when it "
        "speaks (its speech opens the responses)",
    )
