"""`SessionBuilder`: how this worker builds a session's runner and gives its stage slot
back; what opening a session (`manager.py`) and moving one in or out (`moves.py`) share.

It holds the worker's session-wide parts: the plugin, the stage port, the executor the
input work runs on, the one partial-transcript thread, the VAD backend and the event sink.
It keeps no session state: that is the session's record (`table.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.worker.control.table import SessionRecord, SessionTable
from services.worker.engine import native_surfaces, surface
from services.worker.engine.command_marks import CommandMarks
from services.worker.engine.engine_session import EngineSession
from services.worker.engine.input_pipeline import InputPipeline
from services.worker.engine.runner import SessionRunner
from services.worker.engine.transcription import PartialPool
from services.worker.engine.vad import SileroOnnxBackend, VadBackend, VadUnavailable
from shared.contracts import (
    DuplexModelPlugin,
    DuplexSessionConfig,
    DuplexSessionError,
    SessionEventSink,
    SessionRuntimeConfig,
    StagePort,
)
from shared.protocol.duplex import DuplexEvent, RealtimeProtocolError

log = logging.getLogger(__name__)

#: `on_close(session_id, reason)`: a runner asks for its session to be closed from outside
OnClose = Callable[[str, str], None]


class SessionBuilder:
    def __init__(
        self,
        plugin: DuplexModelPlugin,
        runtime: SessionRuntimeConfig,
        sink: SessionEventSink,
        table: SessionTable[SessionRunner],
        *,
        port: StagePort,
        vad_backend: Callable[[], VadBackend] | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.plugin = plugin
        self.runtime = runtime
        self.sink = sink
        self.table = table
        self.port = port
        self.capabilities = plugin.capabilities(runtime.max_sessions)
        self.clock = clock
        self.executor = ThreadPoolExecutor(
            runtime.executor_threads, thread_name_prefix="duplex-session"
        )
        # partial transcripts are previews: one at a time, on a thread of their own, so
        # they never hold up a session's VAD or a committed turn's transcript
        # (transcription.py); one asked for while it is busy is skipped
        self.partial_pool = PartialPool(
            ThreadPoolExecutor(1, thread_name_prefix="duplex-partial"), limit=1
        )
        self._vad_backend = vad_backend or (
            lambda: SileroOnnxBackend.shared(runtime.server_vad_model_path)
        )
        #: set by the manager: a runner's `session.close` reaching the front of its mailbox
        self.on_close: OnClose | None = None
        self._background: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------ building

    def read_config(self, session: Mapping[str, Any]) -> DuplexSessionConfig:
        try:
            return DuplexSessionConfig.from_realtime(session, client=True)
        except RealtimeProtocolError as exc:
            raise DuplexSessionError(exc.code, exc.message, param=exc.param) from None

    def pipeline(self, config: DuplexSessionConfig, stream_ms: int) -> InputPipeline:
        pipeline = InputPipeline(self.plugin.input_sample_rate_hz, self._vad_backend)
        try:
            pipeline.configure_vad(config.turn_detection, stream_ms)
        except VadUnavailable as exc:
            raise DuplexSessionError("server_vad_unavailable", str(exc)) from None
        return pipeline

    def runner(
        self, session: EngineSession, pipeline: InputPipeline, marks: CommandMarks | None = None
    ) -> SessionRunner:
        return SessionRunner(
            session,
            self.plugin,
            self.port,
            self._emitter(session),
            self.executor,
            pipeline,
            on_close=self.on_close,
            marks=marks,
            partial_pool=self.partial_pool,
        )

    def _emitter(self, session: EngineSession) -> Callable[[DuplexEvent], None]:
        """The runner's way out. An openai-surface session's events are projected to
        OpenAI GA's here (`surface.py`), a Moshi or GPT-Live one's to what its API pod sends
        (`native_surfaces.py`), so the journal holds what its client gets; the surface is
        read per event from the config, which an update replaces (and keeps)."""
        sink, session_id = self.sink, session.session_id

        def emit(event: DuplexEvent) -> None:
            config = session.config
            if config.openai_surface or config.native_surface:
                project = surface.project if config.openai_surface else native_surfaces.project
                projected = project(event, session)
                if projected is None:
                    return
                event = projected
            sink.emit(session_id, event)

        return emit

    def emit_closure(self, session: EngineSession, event: DuplexEvent) -> None:
        """A closure emitted from outside the runner (a close, an expiry): as is, but on
        Moshi's and GPT-Live's surfaces as their projection has it (GPT-Live's carries the
        session's usage). The openai surface's pod closes its socket on it unsent."""
        if session.config.native_surface:
            projected = native_surfaces.project(event, session)
            if projected is None:
                return  # GPT-Live's expiry: the close that follows says it
            event = projected
        self.sink.emit(session.session_id, event)

    # ------------------------------------------------------------ giving back

    async def cleanup(self, record: SessionRecord[SessionRunner]) -> bool:
        """Give the session's stage slot back; the record goes if nothing else of it is
        left. False (logged) when the stage refused: the slot stays held, the reaper retries."""
        try:
            await self.port.cleanup(record.session_id)
        except Exception:
            log.exception("stage cleanup of %s failed; the reaper retries it", record.session_id)
            return False
        record.stage_clean = True
        self.table.settle(record)
        return True

    def in_background(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run `work` beside the caller (a close a runner asked for, a dropped session's
        stop); a failure is logged, and `shutdown` waits for what is still running."""
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def background_done(self) -> None:
        """Wait for what `in_background` started so far (a close, a dropped session's stop)."""
        await asyncio.gather(*self._background, return_exceptions=True)

    async def shutdown(self) -> None:
        await self.background_done()
        await self.port.shutdown()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.partial_pool.executor.shutdown(wait=False, cancel_futures=True)
