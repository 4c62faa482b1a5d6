"""The echo model's one stage: replay a turn's audio at the model rate, paced.

Each submitted request runs as one asyncio task; `abort` cancels the task, so
generation stops at its next chunk and nothing of an aborted request is
emitted afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import numpy as np

from shared.contracts import (
    DuplexFence,
    OutputSink,
    StageOutput,
    StagePlan,
    StagePort,
    stage_request_id,
)
from shared.protocol.duplex import StreamingResampler

log = logging.getLogger(__name__)


def split_text(text: str, pieces: int) -> list[str]:
    """`text` in `pieces` consecutive parts (the last ones may be empty) that join back to it."""
    bounds = [round(i * len(text) / pieces) for i in range(pieces + 1)]
    return [text[bounds[i] : bounds[i + 1]] for i in range(pieces)]


def resample_whole(audio: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    resampler = StreamingResampler(in_rate, out_rate)
    return np.concatenate([resampler.process(audio), resampler.flush()])


class EchoStagePort(StagePort):
    def __init__(self) -> None:
        self._sinks: dict[str, OutputSink] = {}
        self._reserved: dict[str, set[str]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def bind(self, session_id: str, sink: OutputSink) -> None:
        self._sinks[session_id] = sink

    async def ensure(self, fence: DuplexFence, role: str) -> str:
        request_id = stage_request_id(fence, role)
        self._reserved.setdefault(fence.session_id, set()).add(request_id)
        return request_id

    async def submit_initial(self, plan: StagePlan) -> None:
        await self.ensure(plan.fence, plan.role)
        previous = self._tasks.pop(plan.request_id, None)
        if previous is not None:
            previous.cancel()
        task = asyncio.create_task(self._stream(plan), name=f"echo-stage:{plan.request_id}")
        self._tasks[plan.request_id] = task
        task.add_done_callback(lambda t, rid=plan.request_id: self._forget(rid, t))

    async def submit_update(self, plan: StagePlan) -> None:
        await self.submit_initial(plan)  # echo requests are one-shot: an update restarts

    async def abort(self, request_ids: Sequence[str]) -> None:
        tasks = [self._tasks.pop(rid) for rid in request_ids if rid in self._tasks]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def cleanup(self, session_id: str) -> None:
        owned = [rid for rid in self._tasks if rid in self._reserved.get(session_id, set())]
        await self.abort(owned)
        self._reserved.pop(session_id, None)
        self._sinks.pop(session_id, None)

    def running_requests(self) -> list[str]:
        return list(self._tasks)

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("echo stage %s failed", request_id, exc_info=task.exception())

    def _emit(self, output: StageOutput) -> None:
        sink = self._sinks.get(output.fence.session_id)
        if sink is not None:
            sink(output)

    async def _stream(self, plan: StagePlan) -> None:
        request = plan.payload
        try:
            audio = await asyncio.to_thread(
                resample_whole, request.audio, request.sample_rate_hz, request.output_rate_hz
            )
        except Exception as exc:  # a stage failure fails the response, never the worker
            self._emit(
                StageOutput(
                    plan.request_id,
                    plan.fence,
                    "error",
                    error_code="runtime_data_plane_stream_failed",
                    message=str(exc),
                )
            )
            return
        chunk = request.output_rate_hz * request.chunk_ms // 1000
        count = max(1, -(-len(audio) // chunk))
        texts = split_text(request.transcript, count)
        started = time.monotonic()
        for index in range(count):
            if request.pace > 0:
                # real-time pacing: chunk i leaves at i chunk-durations after the first
                due = started + index * request.chunk_ms / 1000 / request.pace
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            else:
                await asyncio.sleep(0)
            piece = audio[index * chunk : (index + 1) * chunk]
            self._emit(
                StageOutput(
                    plan.request_id,
                    plan.fence,
                    "audio",
                    audio=piece,
                    sample_rate_hz=request.output_rate_hz,
                    text=texts[index],
                )
            )
        self._emit(StageOutput(plan.request_id, plan.fence, "done", text=request.transcript))
