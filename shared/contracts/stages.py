"""The stage port: how a session's runner drives the model stages.

A session owns "resumable stage requests": long-lived requests whose ids are
derived from the session's fence, so aborting everything an old epoch started
is one call. The runner never talks to an engine directly; it plans, submits
and aborts through a `StagePort`, and receives `StageOutput`s in its mailbox.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shared.contracts.images import ImageInput
from shared.contracts.model_history import ModelHistory


@dataclasses.dataclass(frozen=True)
class DuplexFence:
    """The identity a stage request is bound to. Cancels advance `epoch`."""

    session_id: str
    epoch: int
    turn_id: int


def stage_request_id(fence: DuplexFence, role: str) -> str:
    """`duplex-s.<urlsafe-b64 session id, unpadded>.e.<epoch>.r.<role>` (contract 5)."""
    encoded = base64.urlsafe_b64encode(fence.session_id.encode()).decode().rstrip("=")
    return f"duplex-s.{encoded}.e.{fence.epoch}.r.{role}"


def parse_stage_request_id(request_id: str) -> tuple[str, int, str]:
    """(session_id, epoch, role) of a stage request id."""
    prefix, encoded, e, epoch, r, role = request_id.split(".", 5)
    if (prefix, e, r) != ("duplex-s", "e", "r"):
        raise ValueError(f"not a duplex stage request id: {request_id!r}")
    padded = encoded + "=" * (-len(encoded) % 4)
    return base64.urlsafe_b64decode(padded).decode(), int(epoch), role


@dataclasses.dataclass
class StagePlan:
    """One submission to a stage request: the plugin decides `payload`.

    `client_clock` (a frame-clocked stage's stream only): the session's input is its clock.
    Once its prompt is stepped, its slot is stepped once per whole frame of input that has
    arrived, and only then (a slot whose input has not arrived skips the tick and keeps its
    state), and every frame it steps goes to the session, listening ones too (`QUIET`).
    Moshi's protocol: its reference server steps the model on the client's audio."""

    request_id: str
    fence: DuplexFence
    role: str
    payload: Any
    final: bool = True
    client_clock: bool = False


@dataclasses.dataclass(frozen=True)
class FunctionCall:
    """A complete tool call the model made: the declared tool's `name`, its `arguments` as
    JSON text (the Realtime API's `arguments` string), and `call_id` (the worker makes one
    when None). Whole, never partial: a plugin emits it once the call is fully generated."""

    name: str
    arguments: str = "{}"
    call_id: str | None = None


class OutputKind(enum.StrEnum):
    """What a `StageOutput` is, and which of its fields it carries (the union's tag: the
    session runner handles each in one `match`, `handlers.on_stage_output`)."""

    #: mono float32 `audio` at `sample_rate_hz`, optional `text` for its transcript
    AUDIO = "audio"
    #: words without audio: a text response's text, or in an audio response a transcript
    #: piece with no sound of its own
    TEXT = "text"
    #: the model decided not to speak (in a model-native stream: its response is over)
    LISTEN = "listen"
    #: `function_call`: the response calls a tool; the request still ends with DONE, or in
    #: a model-native stream with LISTEN
    FUNCTION_CALL = "function_call"
    #: the request's turn is complete
    DONE = "done"
    #: `error_code`, `message`: the response fails
    ERROR = "error"
    #: `error_code`, `message`: an `error` event for the client, of no response: the
    #: response in progress and the session go on (a frame-clocked model's
    #: `FrameOutput.error`)
    NONFATAL_ERROR = "nonfatal_error"
    #: a frame-clocked stage's slot has stepped its prompt: the model hears the session
    #: from now on (part of no response)
    READY = "ready"
    #: `audio` at `sample_rate_hz`: a frame a client-clocked slot stepped while its model
    #: listens (`StagePlan.client_clock`), part of no response: its protocol sends every frame
    QUIET = "quiet"


@dataclasses.dataclass
class StageOutput:
    """One output of a stage request, delivered to the owning session's mailbox; `kind`
    says what it is and which fields it carries (`OutputKind`)."""

    request_id: str
    fence: DuplexFence
    kind: OutputKind
    audio: np.ndarray | None = None
    sample_rate_hz: int | None = None
    text: str = ""
    error_code: str | None = None
    message: str = ""
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    function_call: FunctionCall | None = None

    def __post_init__(self) -> None:
        self.kind = OutputKind(self.kind)  # an unknown kind fails where it is made


OutputSink = Callable[[StageOutput], None]


@dataclasses.dataclass(frozen=True)
class TextRequest:
    """The payload of a text-generation stage request (the vLLM stage): a prompt and
    sampling overrides (vLLM `SamplingParams` fields) over the stage's defaults."""

    prompt: str
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class StageCleanupError(RuntimeError):
    """A session's stage cleanup failed; the manager keeps its slot and retries."""


class StagePort(abc.ABC):
    """ensure / submit initial / submit update / abort / cleanup of a session's stage requests.

    Implementations: a plugin's local CPU stages (echo), the vLLM engine stage, the
    tick-batched stage of a frame-clocked model (an `InputFedStagePort`).
    Every method is called from the worker's event loop.
    """

    @abc.abstractmethod
    def bind(self, session_id: str, sink: OutputSink) -> None:
        """Route every output of `session_id`'s requests to `sink` (non-blocking)."""

    @abc.abstractmethod
    async def ensure(self, fence: DuplexFence, role: str) -> str:
        """Reserve the request id for (fence, role) without starting work; idempotent."""

    @abc.abstractmethod
    async def submit_initial(self, plan: StagePlan) -> None:
        """Start the reserved request with its first input."""

    @abc.abstractmethod
    async def abort(self, request_ids: Sequence[str]) -> None:
        """Stop generation of these requests now; no output of theirs follows."""

    @abc.abstractmethod
    async def cleanup(self, session_id: str) -> None:
        """Abort whatever `session_id` still runs and release its reserved ids.
        Raises `StageCleanupError` when it could not; the caller retries."""

    @abc.abstractmethod
    def held_sessions(self) -> frozenset[str]:
        """The sessions the stage keeps anything of (a sink, a reserved id, a slot, a slot
        still closing): none once each has been cleaned up (the session-table tests hold
        every stage to it)."""

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release engine resources when the worker stops."""


class InputFedStagePort(StagePort):
    """A stage port whose stream request hears the session's input as it is applied, not
    in a plan's payload: the tick-batched stage of a frame-clocked model, whose slot is
    stepped on every frame. A model-native session (`NativeStream`) feeds it every
    converted append, in the order its runner applies them."""

    @abc.abstractmethod
    def feed(self, session_id: str, samples: np.ndarray, images: tuple[bytes, ...] = ()) -> None:
        """`session_id`'s converted input: mono float32 at the model's input rate, and the
        camera frames sent with it (encoded images the worker checked against
        `image_input`), which go to the model with the frame that holds the input's last
        sample. Non-blocking; a session with no stream open (closed meanwhile) takes none."""

    @property
    def image_input(self) -> ImageInput | None:
        """The camera frames the stage's model takes with its audio (None: audio only)."""
        return None

    @property
    def state_record_bytes(self) -> int:
        """Bytes of one frame's record of the stage's model, or the most one holds where
        they are sized (`state_records_sized`); 0: its state does not move."""
        return 0

    @property
    def state_records_sized(self) -> bool:
        """The model's records have sizes of their own (model_history.py's layouts)."""
        return False

    def keep_history(self, session_id: str, history: ModelHistory, *, responding: bool) -> None:
        """Before the session's stream request: the model's records of its frames go to
        `history` from now on; a history that holds frames already (a restore) is replayed
        into the slot when the request opens it. `responding`: the session had a response
        in flight when it moved, which the model's next frames go on with."""

    async def function_output(self, session_id: str, call_id: str, name: str, output: str) -> None:
        """The client's result of the call `call_id` (tool `name`) that `session_id`'s model
        made: to the model (`FrameModel.add_function_output` for the session's slot). A
        stage whose model makes no calls raises `NotImplementedError`."""
        raise NotImplementedError(f"{type(self).__name__} takes no function outputs")


__all__ = [
    "DuplexFence",
    "FunctionCall",
    "InputFedStagePort",
    "ModelHistory",
    "OutputKind",
    "OutputSink",
    "StageCleanupError",
    "StageOutput",
    "StagePlan",
    "StagePort",
    "TextRequest",
    "parse_stage_request_id",
    "stage_request_id",
]
