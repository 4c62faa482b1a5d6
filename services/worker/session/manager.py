"""`SessionManager`: admission, dispatch with backpressure, lease operations, close, reaper.

Admission counts live sessions, sessions still closing (a closing session
keeps its slot until its stage cleanup succeeds) and opens in flight, so
concurrent opens can never exceed `max_sessions`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.worker.session import surface
from services.worker.session.command_marks import NO_MARK, CommandMarks, Mark
from services.worker.session.engine_session import EngineSession
from services.worker.session.input_pipeline import InputPipeline
from services.worker.session.lease import LeaseState
from services.worker.session.ledgers import InputLedger
from services.worker.session.moves import SessionMoves
from services.worker.session.runner import Dispatched, SessionRunner
from services.worker.session.transcription import PartialPool
from services.worker.session.vad import SileroOnnxBackend, VadBackend, VadUnavailable
from shared.contracts import (
    DuplexModelPlugin,
    DuplexRuntimeConfigError,
    DuplexSessionConfig,
    DuplexSessionError,
    OpenResult,
    SessionEventSink,
    SessionHost,
    SessionRuntimeConfig,
    StagePort,
)
from shared.ids import EXPIRED_CLOSE_REASON, new_session_id
from shared.protocol.duplex import (
    AppendAudio,
    Commit,
    DuplexCommand,
    DuplexEvent,
    DuplexSessionCreated,
    RealtimeProtocolError,
    SessionClosed,
    SessionExpired,
    SessionUpdated,
)
from shared.supervised import SupervisedLoop

log = logging.getLogger(__name__)

#: The input ledger holds float32 samples (`InputLedger.buffered_bytes` is samples * 4).
_DECODED_SAMPLE_BYTES = 4


def _reserved_input_bytes(command: AppendAudio, pipeline: InputPipeline) -> int:
    """What an append will occupy: its audio decoded and resampled to the model input rate
    (float32), or its payload when that is larger, plus its decoded video frame bytes.

    Counted on the decoded size, not the payload: a small payload can declare a rate
    or header that decodes to far more (8 kHz G.711 becomes 8x its bytes at 16 kHz).
    Sized from the length and declared rate or WAV header, so nothing is decoded here;
    a header that would not decode raises `RealtimeProtocolError`."""
    decoded = pipeline.decoded_samples(command) * _DECODED_SAMPLE_BYTES
    video = sum(len(frame) * 3 // 4 for frame in command.video_frames)
    return max(len(command.audio), decoded) + video


class SessionManager(SessionMoves, SessionHost):
    def __init__(
        self,
        plugin: DuplexModelPlugin,
        runtime: SessionRuntimeConfig,
        sink: SessionEventSink,
        *,
        port: StagePort | None = None,
        vad_backend: Callable[[], VadBackend] | None = None,
        clock: Callable[[], float] = time.monotonic,
        report_load: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.plugin = plugin
        # writes `slots_in_use` where placement reads it (the worker's registration): a
        # close frees its slot there before session.closed is emitted
        self._report_load = report_load
        self.runtime = runtime
        self.sink = sink
        self.port = port or plugin.create_stage_port(runtime)
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
        self._runners: dict[str, SessionRunner] = {}
        self._closing: dict[str, EngineSession] = {}
        self._opening = 0
        self._owners: dict[str, int] = {}  # session -> owner generation (moves.py)
        self._reaper: SupervisedLoop | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._bind_sink()

    # ------------------------------------------------------------ admission

    @property
    def slots_in_use(self) -> int:
        return len(self._runners) + len(self._closing) + self._opening

    def session_ids(self) -> list[str]:
        return list(self._runners)

    def runner(self, session_id: str) -> SessionRunner:
        runner = self._runners.get(session_id)
        if runner is None:
            if session_id in self._closing:
                raise DuplexSessionError("session_closed", f"session {session_id} is closing")
            raise DuplexSessionError("unknown_session", f"no session {session_id}")
        return runner

    async def open(
        self,
        session: Mapping[str, Any],
        *,
        session_id: str | None = None,
        resume_token: str | None = None,
        attachment_generation: int | None = None,
    ) -> OpenResult:
        session_id = session_id or new_session_id()
        self._admit(session_id)
        self._opening += 1  # the slot is held across the awaits below
        try:
            config = self._read_config(session)
            try:
                self.plugin.validate_client_extra_body(config.extra_body)
                runtime_config = await self.plugin.prepare_runtime_config(config)
            except DuplexRuntimeConfigError as exc:
                raise DuplexSessionError(exc.code, exc.message, param=exc.param) from None
            pipeline = self._pipeline(config, 0)
            engine_session = EngineSession(
                session_id=session_id,
                config=config,
                runtime_config=runtime_config,
                capabilities=self.capabilities,
                lease=LeaseState(self.runtime.idle_ttl_s, clock=self.clock),
                input=InputLedger(self.plugin.input_sample_rate_hz),
            )
            runner = self._new_runner(engine_session, pipeline)
            await self.port.ensure(engine_session.fence, self.plugin.stage_roles[0])
            self._runners[session_id] = runner
        finally:
            self._opening -= 1
        self._set_owner(session_id, 1)  # the owner generation of a first placement
        created = DuplexSessionCreated(
            session=engine_session.session_object(),
            attachment_generation=attachment_generation,
            resume_token=resume_token,
        )
        opening: list[DuplexEvent] = [created]
        if not config.openai_surface:  # GA opens with session.created alone
            # vLLM-Omni 0.30.0: session.updated follows the first session.created
            opening.append(SessionUpdated(session=created.session))
        runner.start(*opening)
        body = (
            surface.session_object(config, session_id) if config.openai_surface else created.session
        )
        return OpenResult(session_id, self.capabilities, engine_session.lease.generation, body)

    def _admit(self, session_id: str) -> None:
        """Refuse when every slot is taken or the session is already here."""
        limit = self.runtime.max_sessions
        if self.slots_in_use >= limit:
            log.info("admission refused: %d/%d slots in use", self.slots_in_use, limit)
            raise DuplexSessionError(
                "resource_exhausted", f"duplex_session_capacity_exhausted: limit={limit}"
            )
        if session_id in self._runners or session_id in self._closing:
            raise DuplexSessionError("session_exists", f"session {session_id} already exists")

    def _pipeline(self, config: DuplexSessionConfig, stream_ms: int) -> InputPipeline:
        pipeline = InputPipeline(self.plugin.input_sample_rate_hz, self._vad_backend)
        try:
            pipeline.configure_vad(config.turn_detection, stream_ms)
        except VadUnavailable as exc:
            raise DuplexSessionError("server_vad_unavailable", str(exc)) from None
        return pipeline

    def _new_runner(
        self, session: EngineSession, pipeline: InputPipeline, marks: CommandMarks | None = None
    ) -> SessionRunner:
        return SessionRunner(
            session,
            self.plugin,
            self.port,
            self._emitter(session),
            self.executor,
            pipeline,
            on_close=self._close_later,
            marks=marks,
            partial_pool=self.partial_pool,
        )

    def _read_config(self, session: Mapping[str, Any]) -> DuplexSessionConfig:
        try:
            return DuplexSessionConfig.from_realtime(session, client=True)
        except RealtimeProtocolError as exc:
            raise DuplexSessionError(exc.code, exc.message, param=exc.param) from None

    def _emitter(self, session: EngineSession) -> Callable[[DuplexEvent], None]:
        """The runner's way out. An openai-surface session's events are projected to
        OpenAI GA's here (`surface.py`), so the journal holds what its client gets; the
        surface is read per event from the config, which an update replaces (and keeps)."""
        sink, session_id = self.sink, session.session_id

        def emit(event: DuplexEvent) -> None:
            if session.config.openai_surface:
                projected = surface.project(event, session)
                if projected is None:
                    return
                event = projected
            sink.emit(session_id, event)

        return emit

    # ------------------------------------------------------------ commands

    async def submit(self, session_id: str, command: DuplexCommand, mark: Mark = NO_MARK) -> None:
        """Queue a command; `mark` is its inbox (attachment, seq) (`command_marks`)."""
        runner = self.runner(session_id)
        session = runner.session
        if session.config.openai_surface:
            command = surface.client_command(command)
        reserved = 0
        if isinstance(command, AppendAudio):
            try:
                reserved = _reserved_input_bytes(command, runner.pipeline)
            except RealtimeProtocolError as exc:  # refused before any work is scheduled
                runner.error(exc.code, exc.message, command.event_id, param=exc.param)
                runner.marks.handled(mark)
                return
            pending = session.pending_input_bytes + session.input.buffered_bytes + reserved
            if pending > self.runtime.max_pending_input_bytes_per_session:
                runner.error(
                    "input_backpressure",
                    f"pending input {pending} bytes is over the session's "
                    f"{self.runtime.max_pending_input_bytes_per_session}; commit or clear first",
                    command.event_id,
                )
                runner.marks.handled(mark)
                return
            session.pending_input_bytes += reserved
        elif isinstance(command, Commit):
            if session.pending_commits >= self.runtime.max_pending_turns_per_session:
                runner.error(
                    "input_backpressure",
                    f"{session.pending_commits} commits pending "
                    f"(max {self.runtime.max_pending_turns_per_session})",
                    command.event_id,
                )
                runner.marks.handled(mark)
                return
            session.pending_commits += 1
            reserved = 1
        runner.submit(Dispatched(command, reserved, session.input_generation, mark))

    # ------------------------------------------------------------ lease

    async def touch(self, session_id: str) -> None:
        self.runner(session_id).session.lease.touch(self.clock())

    # ------------------------------------------------------------ close

    def _close_later(self, session_id: str, reason: str) -> None:
        """`session.close` reached the front of the runner's mailbox: close from
        outside the runner (closing stops it)."""
        task = asyncio.create_task(
            self.close(session_id, reason), name=f"session-close:{session_id}"
        )
        self._background.add(task)
        task.add_done_callback(self._closed_later)

    def _closed_later(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())

    async def close(self, session_id: str, reason: str = "client_close") -> None:
        runner = self._runners.pop(session_id, None)
        if runner is None:
            return  # idempotent: already closing, closed or never known
        session = runner.session
        session.state = "closing"
        session.lease.mark_terminal()
        self._closing[session_id] = session
        cleaned = False
        try:
            await runner.stop(reason)
            cleaned = await self._cleanup(session_id)
            if cleaned:
                # the slot is free, here and in the registration placement reads, before
                # session.closed: a client that sees the event can open a replacement at
                # once (vLLM-Omni 0.30.0's promise)
                self._closing.pop(session_id, None)
                await self._report_load_quietly()
        finally:
            # emitted after the cleanup attempt, even when it failed (the slot stays held)
            session.state = "closed"
            self.sink.emit(
                session_id,
                SessionClosed(
                    session_id=session_id,
                    reason=reason,
                    # vLLM-Omni's {type, session_id, reason}, and whether the stage was
                    # cleaned up (false: the slot stays held until the reaper's retry)
                    event={
                        "type": "session.closed",
                        "session_id": session_id,
                        "reason": reason,
                        "cleaned": cleaned,
                    },
                ),
            )
        self._owners.pop(session_id, None)

    async def _report_load_quietly(self) -> None:
        if self._report_load is None:
            return
        try:
            await self._report_load()
        except Exception:  # the next heartbeat writes it again
            log.warning("reporting the load after a close failed", exc_info=True)

    async def _cleanup(self, session_id: str) -> bool:
        try:
            await self.port.cleanup(session_id)
        except Exception:
            log.exception("stage cleanup of %s failed; the reaper retries it", session_id)
            return False
        return True

    async def expire(self, session_id: str, reason: str) -> None:
        """A lease expired: `session.expired`, then close."""
        if session_id not in self._runners:
            return
        self.sink.emit(session_id, SessionExpired(session_id=session_id, reason=reason))
        await self.close(session_id, EXPIRED_CLOSE_REASON)

    # ------------------------------------------------------------ reaper

    async def reap_once(self) -> list[tuple[str, str]]:
        """Expire due leases and retry failed cleanups; returns what expired."""
        now = self.clock()
        due = [
            (sid, reason)
            for sid, runner in list(self._runners.items())
            if (reason := runner.session.lease.expiry(now, busy=runner.session.busy)) is not None
        ]
        for session_id, reason in due:
            await self.expire(session_id, reason)
        for session_id in list(self._closing):
            if await self._cleanup(session_id):
                self._closing.pop(session_id, None)
        return due

    async def _reap(self) -> None:
        await self.reap_once()  # looked up at each tick, so a test may replace reap_once

    def start(self) -> None:
        """The reaper: a failed tick is logged and retried after a backoff pause."""
        if self._reaper is None:
            self._reaper = SupervisedLoop.every(
                "session-reaper", self.runtime.reaper_interval_s, self._reap
            ).start()

    async def shutdown(self, reason: str = "shutdown") -> None:
        if self._reaper is not None:
            await self._reaper.stop()
            self._reaper = None
        await asyncio.gather(*(self.close(sid, reason) for sid in list(self._runners)))
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.port.shutdown()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.partial_pool.executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ chat

    async def chat_completion(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if not self.capabilities.supports_chat_completions:
            raise DuplexSessionError(
                "bad_event", f"{self.plugin.plugin_id} does not serve chat completions"
            )
        # a chat request is a short-lived session: it holds a slot while it runs
        if self.slots_in_use >= self.runtime.max_sessions:
            limit = self.runtime.max_sessions
            raise DuplexSessionError(
                "resource_exhausted", f"duplex_session_capacity_exhausted: limit={limit}"
            )
        self._opening += 1
        try:
            return await self.plugin.chat_completion(messages)
        finally:
            self._opening -= 1
