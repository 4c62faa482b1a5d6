"""`TaskStagePort`: a stage port whose requests each run as one asyncio task.

The bookkeeping every such stage needs (the echo and assistant stages, the vLLM stage):
sinks per session, reserved ids per session, one task per request, abort by cancelling,
cleanup of a session's requests, and outputs that never reach a session after its request
was aborted. Subclasses implement `_run(plan)`, and may add engine work to `abort`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Sequence

from shared.contracts.stages import (
    DuplexFence,
    OutputSink,
    StageOutput,
    StagePlan,
    StagePort,
    stage_request_id,
)

log = logging.getLogger(__name__)


class TaskStagePort(StagePort):
    def __init__(self) -> None:
        self._sinks: dict[str, OutputSink] = {}
        self._reserved: dict[str, set[str]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._aborted: set[str] = set()

    @abc.abstractmethod
    async def _run(self, plan: StagePlan) -> None:
        """Produce the request's outputs with `_emit`; runs as the request's task."""

    def bind(self, session_id: str, sink: OutputSink) -> None:
        self._sinks[session_id] = sink

    async def ensure(self, fence: DuplexFence, role: str) -> str:
        request_id = stage_request_id(fence, role)
        self._reserved.setdefault(fence.session_id, set()).add(request_id)
        return request_id

    async def submit_initial(self, plan: StagePlan) -> None:
        await self.ensure(plan.fence, plan.role)
        if plan.request_id in self._tasks:  # the same epoch and role again: replace it
            await self.abort([plan.request_id])
        self._aborted.discard(plan.request_id)
        task = asyncio.create_task(self._run(plan), name=f"stage:{plan.request_id}")
        self._tasks[plan.request_id] = task
        task.add_done_callback(lambda t, rid=plan.request_id: self._forget(rid, t))

    async def abort(self, request_ids: Sequence[str]) -> None:
        tasks = [self._tasks.pop(rid) for rid in request_ids if rid in self._tasks]
        self._aborted.update(request_ids)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def cleanup(self, session_id: str) -> None:
        reserved = self._reserved.get(session_id, set())
        await self.abort([rid for rid in self._tasks if rid in reserved])
        self._aborted -= reserved
        self._reserved.pop(session_id, None)
        self._sinks.pop(session_id, None)

    def running_requests(self) -> list[str]:
        return list(self._tasks)

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("stage request %s failed", request_id, exc_info=task.exception())

    def _emit(self, output: StageOutput) -> None:
        if output.request_id in self._aborted:
            return  # nothing of an aborted request reaches its session
        sink = self._sinks.get(output.fence.session_id)
        if sink is not None:
            sink(output)

    def _fail(self, plan: StagePlan, exc: BaseException) -> None:
        """A stage failure fails the response, never the worker."""
        self._emit(
            StageOutput(
                plan.request_id,
                plan.fence,
                "error",
                error_code="runtime_data_plane_stream_failed",
                message=str(exc),
            )
        )
