"""`SessionManager`: admission, dispatch with backpressure, lease operations, close, reaper.

Every session is one record of the worker's `SessionTable` (`table.py`). Admission counts
the records that hold a slot: live sessions, opens and restores in flight, and sessions
whose stage cleanup has not succeeded yet, so concurrent opens can never exceed
`max_sessions`. Sessions that outlive this worker (drain, failover, fencing) are the
`moves` component's (`moves.py`); building a runner and giving a stage slot back are the
builder's (`builder.py`), which both use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from services.worker.control.builder import SessionBuilder
from services.worker.control.moves import SessionMoves
from services.worker.control.table import Phase, SessionTable
from services.worker.engine import surface
from services.worker.engine.command_marks import NO_MARK, Mark
from services.worker.engine.engine_session import EngineSession
from services.worker.engine.input_pipeline import InputPipeline
from services.worker.engine.lease import LeaseState
from services.worker.engine.ledgers import InputLedger
from services.worker.engine.native_stream import is_native_stream
from services.worker.engine.runner import Dispatched, SessionRunner
from services.worker.engine.vad import VadBackend
from shared.contracts import (
    DuplexModelPlugin,
    DuplexRuntimeConfigError,
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


class SessionManager(SessionHost):
    """`table`: the worker's session table (the Redis publisher reads it too); an inline
    host without one gets its own."""

    def __init__(
        self,
        plugin: DuplexModelPlugin,
        runtime: SessionRuntimeConfig,
        sink: SessionEventSink,
        *,
        table: SessionTable[SessionRunner] | None = None,
        port: StagePort | None = None,
        vad_backend: Callable[[], VadBackend] | None = None,
        clock: Callable[[], float] = time.monotonic,
        report_load: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.table: SessionTable[SessionRunner] = (
            table if table is not None else SessionTable(runtime.max_sessions)
        )
        self.table.max_sessions = runtime.max_sessions  # admission is the runtime's
        #: the worker-wide parts (plugin, runtime, stage port, capabilities, clock) are the
        #: builder's: `manager.builder.port`, as the sessions are the table's
        self.builder = SessionBuilder(
            plugin,
            runtime,
            sink,
            self.table,
            port=port or plugin.create_stage_port(runtime),
            vad_backend=vad_backend,
            clock=clock,
        )
        self.builder.on_close = self._close_later
        #: sessions that outlive this worker: snapshots, hand-off, restore, drop
        self.moves = SessionMoves(self.table, self.builder)
        # writes `slots_in_use` where placement reads it (the worker's registration): a
        # close frees its slot there before session.closed is emitted
        self._report_load = report_load
        self._reaper: SupervisedLoop | None = None

    # ------------------------------------------------------------ admission

    async def open(
        self,
        session: Mapping[str, Any],
        *,
        session_id: str | None = None,
        resume_token: str | None = None,
        attachment_generation: int | None = None,
    ) -> OpenResult:
        session_id = session_id or new_session_id()
        record = self.table.reserve(session_id)  # the slot is held across the awaits below
        builder = self.builder
        plugin = builder.plugin
        try:
            config = builder.read_config(session)
            if config.native_surface and not is_native_stream(plugin):
                raise DuplexSessionError(
                    "invalid_session_config",
                    f"the {config.surface} surface serves native full-duplex (frame-clocked) "
                    f"models; {plugin.plugin_id} is not one",
                    param="model",
                )
            try:
                plugin.validate_client_extra_body(config.extra_body)
                runtime_config = await plugin.prepare_runtime_config(config)
            except DuplexRuntimeConfigError as exc:
                raise DuplexSessionError(exc.code, exc.message, param=exc.param) from None
            pipeline = builder.pipeline(config, 0)
            engine_session = EngineSession(
                session_id=session_id,
                config=config,
                runtime_config=runtime_config,
                capabilities=builder.capabilities,
                lease=LeaseState(builder.runtime.idle_ttl_s, clock=builder.clock),
                input=InputLedger(plugin.input_sample_rate_hz),
            )
            runner = builder.runner(engine_session, pipeline)
            await builder.port.ensure(engine_session.fence, plugin.stage_roles[0])
        except BaseException:
            self.table.abort(record)  # refused: the reservation goes, nothing else
            raise
        # 1: the owner generation of a first placement
        record.serve(
            runner, history=runner.history, owner_generation=1, unstamped=not config.stamps_seq
        )
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
        return OpenResult(session_id, builder.capabilities, engine_session.lease.generation, body)

    # ------------------------------------------------------------ commands

    async def submit(self, session_id: str, command: DuplexCommand, mark: Mark = NO_MARK) -> None:
        """Queue a command; `mark` is its inbox (attachment, seq) (`command_marks`)."""
        runner = self.table.runner(session_id)
        session = runner.session
        runtime = self.builder.runtime
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
            if pending > runtime.max_pending_input_bytes_per_session:
                runner.error(
                    "input_backpressure",
                    f"pending input {pending} bytes is over the session's "
                    f"{runtime.max_pending_input_bytes_per_session}; commit or clear first",
                    command.event_id,
                )
                runner.marks.handled(mark)
                return
            session.pending_input_bytes += reserved
        elif isinstance(command, Commit):
            if session.pending_commits >= runtime.max_pending_turns_per_session:
                runner.error(
                    "input_backpressure",
                    f"{session.pending_commits} commits pending "
                    f"(max {runtime.max_pending_turns_per_session})",
                    command.event_id,
                )
                runner.marks.handled(mark)
                return
            session.pending_commits += 1
            reserved = 1
        runner.submit(Dispatched(command, reserved, session.input_generation, mark))

    # ------------------------------------------------------------ lease

    async def touch(self, session_id: str) -> None:
        self.table.runner(session_id).session.lease.touch(self.builder.clock())

    # ------------------------------------------------------------ close

    def _close_later(self, session_id: str, reason: str) -> None:
        """`session.close` reached the front of the runner's mailbox: close from
        outside the runner (closing stops it)."""
        self.builder.in_background(self.close(session_id, reason), f"session-close:{session_id}")

    async def close(self, session_id: str, reason: str = "client_close") -> None:
        record = self.table.get(session_id)
        if record is None or record.phase is not Phase.LIVE or record.runner is None:
            return  # idempotent: already closing, closed or never known
        runner = record.runner
        session = runner.session
        record.phase = Phase.LEAVING
        session.lease.mark_terminal()
        cleaned = False
        try:
            await runner.stop(reason)
            # the slot is free, here and in the registration placement reads, before
            # session.closed: a client that sees the event can open a replacement at once
            # (vLLM-Omni 0.30.0's promise)
            cleaned = await self.builder.cleanup(record)
            if cleaned:
                await self._report_load_quietly()
        finally:
            # emitted after the cleanup attempt, even when it failed (the slot stays held)
            self.builder.emit_closure(
                session,
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
            record.phase = Phase.GONE
            self.table.settle(record)

    async def _report_load_quietly(self) -> None:
        if self._report_load is None:
            return
        try:
            await self._report_load()
        except Exception:  # the next heartbeat writes it again
            log.warning("reporting the load after a close failed", exc_info=True)

    async def expire(self, session_id: str, reason: str) -> None:
        """A lease expired: `session.expired`, then close."""
        if session_id not in self.table.live_ids():
            return
        session = self.table.runner(session_id).session
        self.builder.emit_closure(session, SessionExpired(session_id=session_id, reason=reason))
        await self.close(session_id, EXPIRED_CLOSE_REASON)

    # ------------------------------------------------------------ reaper

    async def reap_once(self) -> list[tuple[str, str]]:
        """Expire due leases and retry failed cleanups; returns what expired."""
        now = self.builder.clock()
        due = [
            (record.session_id, reason)
            for record in self.table.live()
            if record.runner is not None
            and (reason := record.runner.session.lease.expiry(now, busy=record.runner.session.busy))
            is not None
        ]
        for session_id, reason in due:
            await self.expire(session_id, reason)
        for record in self.table:
            if record.phase in (Phase.LEAVING, Phase.GONE) and not record.stage_clean:
                await self.builder.cleanup(record)
        await self._cleanup_strays()
        return due

    async def _cleanup_strays(self) -> None:
        """What the stage holds of a session with no record here is a leak (a record goes
        only once its stage is clean: `SessionBuilder.cleanup`): it is cleaned up, and said,
        so a slot is never lost to a bug until the worker restarts."""
        known = {record.session_id for record in self.table}
        port = self.builder.port
        for session_id in sorted(port.held_sessions() - known):
            if session_id in self.table:
                continue  # opened or restored here while an earlier stray was cleaned up
            log.warning("stage held session %s with no record here: cleaning it up", session_id)
            try:
                await port.cleanup(session_id)
            except Exception:
                log.exception("stage cleanup of stray session %s failed", session_id)

    async def _reap(self) -> None:
        await self.reap_once()  # looked up at each tick, so a test may replace reap_once

    def start(self) -> None:
        """The reaper: a failed tick is logged and retried after a backoff pause."""
        if self._reaper is None:
            self._reaper = SupervisedLoop.every(
                "session-reaper", self.builder.runtime.reaper_interval_s, self._reap
            ).start()

    async def shutdown(self, reason: str = "shutdown") -> None:
        if self._reaper is not None:
            await self._reaper.stop()
            self._reaper = None
        await asyncio.gather(*(self.close(sid, reason) for sid in self.table.live_ids()))
        await self.builder.shutdown()

    # ------------------------------------------------------------ chat

    async def chat_completion(self, messages: Sequence[Mapping[str, Any]]) -> str:
        plugin = self.builder.plugin
        if not self.builder.capabilities.supports_chat_completions:
            raise DuplexSessionError(
                "bad_event", f"{plugin.plugin_id} does not serve chat completions"
            )
        # a chat request is a short-lived session: it holds a slot while it runs
        self.table.check_room()
        self.table.chats += 1
        try:
            return await plugin.chat_completion(messages)
        finally:
            self.table.chats -= 1
