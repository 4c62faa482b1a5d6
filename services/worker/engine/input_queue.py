"""`InputQueue`: the one task per session that does the slow half of input work, in order.

Invariant: the input task never writes the session. It reads the input generation (to
skip work that an input.cancel made stale before spending a conversion on it, and before
the stale audio reaches the resampler and VAD that the cancel reset) and the silence RMS
setting, and hands every result to the runner's mailbox as an item that carries the
generation it was scheduled under; the runner's task applies it (`InputController`).

Order: work leaves the queue in the order it was put, and each item's result is in the
mailbox before the next item starts. So appends are converted in order, a commit flushes
the resampler after the appends before it, and an `InOrder` command reaches the mailbox
after the results of everything queued before it.

A stale item delivers no result: the cancel that made it stale zeroed the reservations of
its generation, so there is nothing to give back; an item with a command mark delivers a
`Dropped` instead, so the runner counts its command complete (`command_marks`). A
cancelled task leaves its work unfinished; `stop` returns it so the session can give its
reservations back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any

import numpy as np

from services.worker.engine.command_marks import NO_MARK, Mark
from services.worker.engine.engine_session import EngineSession
from services.worker.engine.input_pipeline import ConvertedAppend, InputPipeline
from shared.protocol.duplex import AppendAudio, Commit, DuplexCommand, RealtimeProtocolError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class AppendReady:
    """A converted append; `error` is the client's fault, `failed` ours (logged)."""

    command: AppendAudio
    generation: int
    reserved: int
    result: ConvertedAppend | None = None
    error: RealtimeProtocolError | None = None
    failed: bool = False
    mark: Mark = NO_MARK
    #: its camera frames for a model-native stream's model (`AppendWork.images`)
    images: tuple[bytes, ...] = ()


@dataclasses.dataclass
class CommitReady:
    """A commit whose resampler tail is flushed; `failed`: the flush raised (logged)."""

    command: Commit
    generation: int
    tail: np.ndarray
    failed: bool = False
    mark: Mark = NO_MARK


@dataclasses.dataclass
class Barrier:
    """The runner's `settle_input`: resolved when it has passed the mailbox, then the
    input queue (behind every input work queued before it)."""

    done: asyncio.Future[None]


@dataclasses.dataclass
class InOrder:
    """A command that must see every earlier append and commit applied first: it passes
    through the queue unchanged, behind them."""

    command: DuplexCommand | Barrier
    mark: Mark = NO_MARK


@dataclasses.dataclass
class Dropped:
    """Stale work that carried a command mark: nothing to apply, its command is complete."""

    mark: Mark


@dataclasses.dataclass
class AppendWork:
    command: AppendAudio
    generation: int
    reserved: int
    mark: Mark = NO_MARK
    #: the append's camera frames, decoded at its dispatch (a model-native stream's
    #: model takes them with its audio; nothing here looks at them)
    images: tuple[bytes, ...] = ()


@dataclasses.dataclass
class CommitWork:
    command: Commit
    generation: int
    mark: Mark = NO_MARK


Work = AppendWork | CommitWork | InOrder
Ready = AppendReady | CommitReady | InOrder | Dropped


def start_task(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A session's long-lived task: named (a task dump reads) and logged if it dies."""
    task = asyncio.create_task(coro, name=name)
    task.add_done_callback(_log_failure)
    return task


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s failed", task.get_name(), exc_info=task.exception())


class InputQueue:
    def __init__(
        self,
        session: EngineSession,
        pipeline: InputPipeline,
        executor: Executor,
        deliver: Callable[[Ready], None],
    ) -> None:
        self._session = session  # read only (module docstring)
        self.pipeline = pipeline
        self._executor = executor
        self._deliver = deliver
        self._queue: asyncio.Queue[Work] = asyncio.Queue()
        self._current: Work | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return f"session-input:{self._session.session_id}"

    @property
    def idle(self) -> bool:
        """No work queued or under way."""
        return self._current is None and self._queue.empty()

    def put(self, work: Work) -> None:
        self._queue.put_nowait(work)

    def start(self) -> None:
        # Not a SupervisedLoop: `_run` survives the failure of any one item (logged, and
        # handed back so the runner releases its reservation), so only cancellation ends
        # it; a restart after a pause would only delay the audio queued behind.
        if self._task is None:
            self._task = start_task(self._run(), self.name)

    async def stop(self) -> list[Work]:
        """Cancel the task; returns the work it had not delivered, oldest first."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        unfinished = [self._current] if self._current is not None else []
        self._current = None
        while not self._queue.empty():
            unfinished.append(self._queue.get_nowait())
        return unfinished

    async def _run(self) -> None:
        while True:
            work = await self._queue.get()
            self._current = work
            ready = await self._do(work)
            if ready is not None:
                self._deliver(ready)
            self._current = None

    async def _do(self, work: Work) -> Ready | None:
        if isinstance(work, InOrder):
            return work
        if work.generation != self._session.input_generation:
            # stale (module docstring)
            return Dropped(work.mark) if work.mark != NO_MARK else None
        if isinstance(work, AppendWork):
            return await self._convert(work)
        return await self._flush(work)

    async def _convert(self, work: AppendWork) -> AppendReady:
        # hot path: every audio frame of the session passes here, one at a time
        ready = AppendReady(
            work.command, work.generation, work.reserved, mark=work.mark, images=work.images
        )
        silence_rms = self._session.config.overlap_silence_rms
        try:
            if self.pipeline.runs_inline(work.command):
                ready.result = self.pipeline.convert(work.command, silence_rms)
            else:
                ready.result = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self.pipeline.convert, work.command, silence_rms
                )
        except RealtimeProtocolError as exc:
            ready.error = exc
        except Exception:
            log.exception("%s: converting an append failed", self.name)
            ready.failed = True
        return ready

    async def _flush(self, work: CommitWork) -> CommitReady:
        try:
            tail = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.pipeline.flush
            )
        except Exception:
            log.exception("%s: flushing the resampler at a commit failed", self.name)
            return CommitReady(work.command, work.generation, _EMPTY, failed=True, mark=work.mark)
        return CommitReady(work.command, work.generation, tail, mark=work.mark)


_EMPTY = np.zeros(0, np.float32)
