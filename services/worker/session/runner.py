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

from services.worker.session.engine_session import EngineSession
from services.worker.session.handlers import SessionContext, apply_result, dispatch
from services.worker.session.input_controller import InputController
from services.worker.session.input_pipeline import InputPipeline
from services.worker.session.input_queue import start_task
from services.worker.session.response_controller import ResponseController
from shared.contracts import (
    DuplexModelPlugin,
    StageOutput,
    StagePort,
)
from shared.protocol.duplex import CodedError, DuplexErrorEvent, DuplexEvent

log = logging.getLogger(__name__)

Emit = Callable[[DuplexEvent], None]


#: errors that carry the contract's code for the client; anything else is ours
@dataclasses.dataclass
class Dispatched:
    """A command with what the manager reserved for it (input bytes, or 1 pending turn)."""

    command: Any
    reserved: int = 0
    generation: int = 0  # the session's input generation when the manager reserved


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
    ) -> None:
        self.session = session
        self.port = port
        self._emit_event = emit
        self._mailbox: asyncio.Queue[Any] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.responses = ResponseController(session, plugin, port, self.emit)
        self.input = InputController(
            session, plugin, pipeline, executor, self.responses, self.emit, self.submit
        )
        self._context = SessionContext(
            session, plugin, self.input, self.responses, self.emit, on_close
        )

    @property
    def pipeline(self) -> InputPipeline:
        return self.input.pipeline

    @property
    def dropped_stale_outputs(self) -> int:
        return self.responses.dropped_stale_outputs

    # ------------------------------------------------------------ lifecycle

    def start(self, first_event: DuplexEvent) -> None:
        self.port.bind(self.session.session_id, self.on_stage_output)
        self.emit(first_event)
        # Not a SupervisedLoop: `_run` turns the failure of any one item into an error
        # event and goes on, so only `stop` ends it; a restart would have nothing to redo.
        self._task = start_task(self._run(), f"session-runner:{self.session.session_id}")
        self.input.start()

    async def stop(self, reason: str) -> None:
        """Stop processing; a response still active ends with the cancelled chain."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # the runner's task has ended: from here this coroutine is the session's one writer
        await self.input.stop()
        await self.responses.close(reason)

    # ------------------------------------------------------------ mailbox

    def submit(self, item: Any) -> None:
        self._mailbox.put_nowait(item)

    def on_stage_output(self, output: StageOutput) -> None:
        """Stage outputs enter the mailbox; they never touch the session inline."""
        self._mailbox.put_nowait(output)

    def emit(self, event: DuplexEvent) -> None:
        self._emit_event(event)

    def error(
        self, code: str, message: str, related_event_id: str | None = None, **extra: Any
    ) -> None:
        self.emit(
            DuplexErrorEvent.for_code(code, message, related_event_id=related_event_id, **extra)
        )

    async def _run(self) -> None:
        while True:
            item = await self._mailbox.get()
            event_id = getattr(getattr(item, "command", item), "event_id", None)
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
                self.error("internal_error", f"{type(item).__name__} failed: {exc}", event_id)

    async def _handle(self, item: Any) -> None:
        if await apply_result(self._context, item):
            return
        if isinstance(item, Dispatched):
            self.session.lease.touch()
            if item.reserved and item.generation != self.session.input_generation:
                self.input.reserve_again(item.command, item.reserved)
            await dispatch(self._context, item.command, item.reserved)
        else:
            self.session.lease.touch()
            await dispatch(self._context, item)
