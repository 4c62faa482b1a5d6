"""`TaskStagePort`: a stage port whose requests each run as one asyncio task.

The bookkeeping every such stage needs (the echo and assistant stages, the vLLM stage):
one record per session (its sink, reserved and aborted ids), one task per request, abort
by cancelling, cleanup of a session's requests, and outputs that never reach a session
after its request was aborted. Subclasses implement `_run(plan)`, and may add engine work
to `abort`.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
from collections.abc import Sequence

from shared.contracts.stages import (
    DuplexFence,
    OutputKind,
    OutputSink,
    StageOutput,
    StagePlan,
    StagePort,
    parse_stage_request_id,
    stage_request_id,
)

log = logging.getLogger(__name__)


def _session_of(request_id: str) -> str:
    try:
        return parse_stage_request_id(request_id)[0]
    except ValueError:
        return ""  # not a stage request id: no session's


@dataclasses.dataclass
class _StageSession:
    """What the stage keeps of one session, from its `bind` (or first `ensure`) to its
    `cleanup`: where its outputs go, the request ids it reserved, and those aborted (none of
    their outputs reach it again)."""

    sink: OutputSink | None = None
    reserved: set[str] = dataclasses.field(default_factory=set)
    aborted: set[str] = dataclasses.field(default_factory=set)


class TaskStagePort(StagePort):
    def __init__(self) -> None:
        #: each session's one record here
        self._sessions: dict[str, _StageSession] = {}
        #: each running request's task (a request's id names its session)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @abc.abstractmethod
    async def _run(self, plan: StagePlan) -> None:
        """Produce the request's outputs with `_emit`; runs as the request's task."""

    def _session(self, session_id: str) -> _StageSession:
        entry = self._sessions.get(session_id)
        if entry is None:
            entry = self._sessions[session_id] = _StageSession()
        return entry

    def bind(self, session_id: str, sink: OutputSink) -> None:
        self._session(session_id).sink = sink

    async def ensure(self, fence: DuplexFence, role: str) -> str:
        request_id = stage_request_id(fence, role)
        self._session(fence.session_id).reserved.add(request_id)
        return request_id

    async def submit_initial(self, plan: StagePlan) -> None:
        await self.ensure(plan.fence, plan.role)
        if plan.request_id in self._tasks:  # the same epoch and role again: replace it
            await self.abort([plan.request_id])
        self._session(plan.fence.session_id).aborted.discard(plan.request_id)
        task = asyncio.create_task(self._run(plan), name=f"stage:{plan.request_id}")
        self._tasks[plan.request_id] = task
        task.add_done_callback(lambda t, rid=plan.request_id: self._forget(rid, t))

    async def abort(self, request_ids: Sequence[str]) -> None:
        tasks = [self._tasks.pop(rid) for rid in request_ids if rid in self._tasks]
        self._mark_aborted(request_ids)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def cleanup(self, session_id: str) -> None:
        entry = self._sessions.get(session_id)
        if entry is not None:
            await self.abort([rid for rid in self._tasks if rid in entry.reserved])
        self._sessions.pop(session_id, None)

    def _mark_aborted(self, request_ids: Sequence[str]) -> None:
        """From now on nothing of these requests reaches their sessions (`_emit`)."""
        for request_id in request_ids:
            entry = self._sessions.get(_session_of(request_id))
            if entry is not None:
                entry.aborted.add(request_id)

    def held_sessions(self) -> frozenset[str]:
        return frozenset(self._sessions)

    def running_requests(self) -> list[str]:
        return list(self._tasks)

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("stage request %s failed", request_id, exc_info=task.exception())

    def _emit(self, output: StageOutput) -> None:
        entry = self._sessions.get(output.fence.session_id)
        if entry is None or entry.sink is None or output.request_id in entry.aborted:
            return  # nothing of an aborted request reaches its session
        entry.sink(output)

    def _fail(self, plan: StagePlan, exc: BaseException) -> None:
        """A stage failure fails the response, never the worker."""
        self._emit(
            StageOutput(
                plan.request_id,
                plan.fence,
                OutputKind.ERROR,
                error_code="runtime_data_plane_stream_failed",
                message=str(exc),
            )
        )
