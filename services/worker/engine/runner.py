"""`SessionRunner`: one session's mailbox, its error mapping and its lifecycle.

Invariant (single writer): the runner's task is the only writer of its `EngineSession`.
Everything that changes the session enters one mailbox and is applied there in order,
one item at a time: client commands (through the dispatch table, `handlers`), stage
outputs (`ResponseController`) and the results of input work (`InputController`). The
session's input task converts audio but writes nothing; its results come back here as
`AppendReady` / `CommitReady` / `InOrder` items. `stop` writes too, but only after the
runner's task has ended.

Errors: a coded error raised by an item becomes the contract's error event, tied to the
client's event id; any other exception is a bug in that one item and becomes an
`internal_error`: the session goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from services.worker.engine.command_marks import NO_MARK, CommandMarks, CommandTicket, Mark
from services.worker.engine.engine_session import EngineSession
from services.worker.engine.handlers import SessionContext, dispatch, on_stage_output
from services.worker.engine.idle_timeout import IdleDue
from services.worker.engine.input_controller import InputController
from services.worker.engine.input_pipeline import InputPipeline
from services.worker.engine.input_queue import (
    AppendReady,
    Barrier,
    CommitReady,
    Dropped,
    InOrder,
    start_task,
)
from services.worker.engine.native_stream import (
    NativeStream,
    OpenStream,
    is_native_stream,
)
from services.worker.engine.response_controller import ResponseController
from services.worker.engine.transcription import PartialPool, PartialTranscript
from shared.contracts import (
    DuplexModelPlugin,
    ModelHistory,
    StageOutput,
    StagePort,
)
from shared.protocol.duplex import CodedError, DuplexCommand, DuplexErrorEvent, DuplexEvent
from shared.protocol.duplex.errors import INTERNAL_ERROR, STREAM_FAILED

log = logging.getLogger(__name__)

Emit = Callable[[DuplexEvent], None]


@dataclasses.dataclass
class Dispatched:
    """A command with what the manager reserved for it (input bytes, or 1 pending turn)
    and its inbox mark, (attachment, seq) (`command_marks`)."""

    command: DuplexCommand
    reserved: int = 0
    generation: int = 0  # the session's input generation when the manager reserved
    mark: Mark = NO_MARK


@dataclasses.dataclass
class _CancelActive:
    """`cancel_active`: the active response (if any) ends with the cancelled chain."""

    reason: str
    done: asyncio.Future[None]


#: What the mailbox holds, and who puts it there: `submit` gets `Dispatched` (the manager),
#: `OpenStream` (`start`, model-native sessions only), `Barrier` / `_CancelActive`
#: (`_control`) and the input controller's `AppendReady` / `CommitReady` / `InOrder` /
#: `Dropped`, `PartialTranscript` and `IdleDue`; `on_stage_output` gets `StageOutput`.
#: `SessionRunner._handle` takes each in one match. (A bare command is none of these: once
#: dispatched here it would have skipped its reservation and mark.)
MailboxItem = (
    Dispatched
    | Barrier
    | _CancelActive
    | OpenStream
    | AppendReady
    | CommitReady
    | InOrder
    | Dropped
    | PartialTranscript
    | IdleDue
    | StageOutput
)


class SessionRunner:
    def __init__(
        self,
        session: EngineSession,
        plugin: DuplexModelPlugin,
        port: StagePort,
        emit: Emit,
        executor: Executor,
        pipeline: InputPipeline,
        on_close: Callable[[str, str], None] | None = None,
        marks: CommandMarks | None = None,
        partial_pool: PartialPool | None = None,
    ) -> None:
        """`partial_pool`: the worker's, shared by its sessions (`transcription.py`);
        without it the session's partial decodes run on `executor`."""
        self.session = session
        self.port = port
        self._emit_event = emit
        self._mailbox: asyncio.Queue[MailboxItem] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.marks = marks or CommandMarks()
        self._dispatched = 0  # commands in the mailbox, not yet handled
        self._waiters: set[asyncio.Future[None]] = set()  # settle / cancel_active callers
        self.responses = ResponseController(session, plugin, port, self.emit)
        if is_native_stream(plugin):  # a frame-clocked model: one stream, its model speaks
            self.responses.native = NativeStream(session, plugin, port)
        self.input = InputController(
            session, plugin, pipeline, executor, self.responses, self.emit, self.submit
        )
        if partial_pool is not None:
            self.input.partials.pool = partial_pool
        self._context = SessionContext(
            session, plugin, self.input, self.responses, self.emit, on_close
        )

    @property
    def pipeline(self) -> InputPipeline:
        return self.input.pipeline

    @property
    def history(self) -> ModelHistory | None:
        """A model-native session's model history (its stream's), None for any other."""
        native = self.responses.native
        return native.history if native is not None else None

    @property
    def dropped_stale_outputs(self) -> int:
        return self.responses.dropped_stale_outputs

    # ------------------------------------------------------------ lifecycle

    def start(self, *first_events: DuplexEvent) -> None:
        """`first_events`: session.created (and on the duplex surface session.updated) at
        an open; none at a restore."""
        self.port.bind(self.session.session_id, self.on_stage_output)
        for event in first_events:
            self.emit(event)
        if self.responses.native is not None:
            self.submit(OpenStream())  # before any command: the model hears from the start
        # Not a SupervisedLoop: `_run` turns the failure of any one item into an error
        # event and goes on, so only `stop` ends it; a restart would have nothing to redo.
        self._task = start_task(self._run(), f"session-runner:{self.session.session_id}")
        self.input.start()

    async def stop(self, reason: str) -> None:
        """Stop processing; a response still active ends with the cancelled chain."""
        await self.halt()
        await self.responses.close(reason)

    async def halt(self) -> None:
        """Stop processing and leave the responses as they are (a model-native session's
        hand-off: its response goes on on the next worker); `stop` after it closes them."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # the runner's task has ended: from here the caller is the session's one writer
        await self.input.stop()
        for done in list(self._waiters):  # control items that will never be handled now
            if not done.done():
                done.set_result(None)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def silence(self) -> None:
        """Emit nothing from now on (the session was fenced out or handed off)."""
        self._emit_event = _discard

    @property
    def input_idle(self) -> bool:
        """No command waiting in the mailbox and no input work queued or converting."""
        return self._dispatched == 0 and self.input.queue.idle

    async def settle_input(self) -> None:
        """Wait until every command submitted so far has been handled and the input work
        it queued, and any that work queued in turn (a server-VAD commit), is applied."""
        while True:
            if not self.running:
                raise RuntimeError(f"session {self.session.session_id}: the runner is stopped")
            await self._control(Barrier)
            if self.input_idle:
                return

    async def cancel_active(self, reason: str) -> None:
        """The active response, if any, ends with the cancelled chain (on the runner's task)."""
        if self.running:
            await self._control(lambda done: _CancelActive(reason, done))

    async def _control(self, make: Callable[[asyncio.Future[None]], MailboxItem]) -> None:
        """Put a control item in the mailbox and wait until the runner's task has handled
        it (or the runner stopped)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(done)
        try:
            self.submit(make(done))
            await done
        finally:
            self._waiters.discard(done)

    # ------------------------------------------------------------ mailbox

    def submit(self, item: MailboxItem) -> None:
        if isinstance(item, Dispatched):
            self._dispatched += 1
            self.marks.begin(item.mark)
        self._mailbox.put_nowait(item)

    def on_stage_output(self, output: StageOutput) -> None:
        """Stage outputs enter the mailbox; they never touch the session inline."""
        self._mailbox.put_nowait(output)

    def emit(self, event: DuplexEvent) -> None:
        self._emit_event(event)
        self.input.observe(event)  # the idle timer follows responses and speech

    def error(
        self, code: str, message: str, related_event_id: str | None = None, **extra: Any
    ) -> None:
        self.emit(
            DuplexErrorEvent.for_code(code, message, related_event_id=related_event_id, **extra)
        )

    async def _run(self) -> None:
        while True:
            item = await self._mailbox.get()
            event_id = _event_id(item)
            try:
                await self._handle(item)
            except CodedError as exc:
                # `param` too: the same refusal at submit (manager) names the field
                extra = {"param": exc.param} if exc.param else {}
                self.error(exc.code, exc.message, exc.related_event_id or event_id, **extra)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug in one command must not kill the session
                log.exception("session %s: %s failed", self.session.session_id, type(item).__name__)
                self.error(INTERNAL_ERROR, f"{type(item).__name__} failed: {exc}", event_id)

    async def _handle(self, item: MailboxItem) -> None:
        match item:
            case Dispatched():
                await self._dispatch(item)
            case Barrier():
                self.input.queue.put(InOrder(item))  # behind the input work queued so far
            case InOrder(command=Barrier(done=done)):
                if not done.done():
                    done.set_result(None)
            case _CancelActive(reason=reason, done=done):
                try:
                    if self.session.active is not None:
                        await self.responses.advance_epoch(reason)
                finally:
                    if not done.done():
                        done.set_result(None)
            case OpenStream() if self.responses.native is not None:
                await self._open_stream(self.responses.native)
            case StageOutput():
                await on_stage_output(self._context, item)
            # an input result completes its command (its mark), whatever came of it
            case AppendReady():
                with self.marks.completing(item.mark):
                    await self.input.on_append_ready(item)
            case CommitReady():
                with self.marks.completing(item.mark):
                    await self.input.on_commit_ready(item)
            case InOrder():
                with self.marks.completing(item.mark):
                    await dispatch(self._context, item.command, in_order=True)
            case Dropped():
                self.marks.complete(item.mark)
            case PartialTranscript():  # the session's own timers and decodes
                self.input.on_partial(item)
            case IdleDue():
                await self.input.on_idle_due(item)
            case _:  # a wrong item (`MailboxItem`) is a bug: it fails loudly
                raise TypeError(
                    f"session {self.session.session_id}: {type(item).__name__} "
                    "is not a mailbox item"
                )

    async def _open_stream(self, native: NativeStream) -> None:
        """The model's slot opens; if it cannot, the session has nothing left to serve: its
        error, then it closes (the slot goes back), rather than a session that never speaks."""
        try:
            await native.open()
        except CodedError as exc:
            self.error(exc.code, exc.message, param=exc.param)
            if self._context.on_close is not None:
                self._context.on_close(self.session.session_id, STREAM_FAILED)

    async def _dispatch(self, item: Dispatched) -> None:
        self._dispatched -= 1
        self.session.lease.touch()
        if item.reserved and item.generation != self.session.input_generation:
            self.input.reserve_again(item.command, item.reserved)
        ticket = CommandTicket(item.reserved, item.mark)
        try:
            await dispatch(self._context, item.command, ticket)
        finally:
            if not ticket.deferred:  # else it completes when its input work is applied
                self.marks.complete(item.mark)


def _event_id(item: object) -> str | None:
    """The client's event id of the command a mailbox item carries (errors name it)."""
    if isinstance(item, Dispatched | AppendReady | CommitReady | InOrder):
        command = item.command
        return command.event_id if isinstance(command, DuplexCommand) else None
    return None


def _discard(event: DuplexEvent) -> None:
    pass
