"""`SessionRunner`: the only writer of one `EngineSession`.

Everything that changes the session passes through one mailbox, in order:
client commands, stage outputs, and internal items (finished appends and
commits, VAD turns). Slow work (decode, resample, VAD) runs in tracked tasks
on the executor and comes back to the mailbox as an internal item carrying the
input generation it started under; a stale item is dropped and its
reservation released.

Two fences, because a duplex session has two independent streams:
- the response epoch: response.cancel, output_audio_buffer.clear, barge_in and
  input.cancel advance it, emit the cancelled terminal chain and then abort the
  stage request, so nothing of the old epoch is emitted after its terminal
  event (late stage outputs are consumed and dropped);
- the input generation: input_audio_buffer.clear and input.cancel advance it,
  dropping appends still in flight. A barge-in does NOT drop them: the speech
  that interrupted the model is the user's next turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np

from services.worker.session import commands as handlers
from services.worker.session.engine_session import EngineSession, new_item_id
from services.worker.session.input_pipeline import ConvertedAppend, InputPipeline
from services.worker.session.response import (
    CANCELLED,
    COMPLETED,
    FAILED,
    ActiveResponse,
    audio_events,
    finish_events,
    new_response_id,
    speak_events,
    start_events,
)
from shared.contracts import (
    CommittedTurn,
    DuplexModelPlugin,
    DuplexRuntimeConfigError,
    DuplexSessionError,
    ResponseCreateOptions,
    ResponsePlanRequest,
    StageOutput,
    StagePort,
)
from shared.protocol.duplex import (
    ACK_ONLY,
    AppendAudio,
    Commit,
    DuplexErrorEvent,
    DuplexEvent,
    InputAudioBufferSpeechStarted,
    InputAudioBufferSpeechStopped,
    OutputAudioEncoder,
    OverlapDecision,
    RealtimeProtocolError,
    b64encode_audio,
)

log = logging.getLogger(__name__)

Emit = Callable[[DuplexEvent], None]


@dataclasses.dataclass
class Dispatched:
    """A command with what the manager reserved for it (input bytes, or 1 pending turn)."""

    command: Any
    reserved: int = 0


@dataclasses.dataclass
class _AppendReady:
    command: AppendAudio
    generation: int
    reserved: int
    result: ConvertedAppend | None = None
    error: RealtimeProtocolError | None = None


@dataclasses.dataclass
class _InOrder:
    """A command that must see every earlier append and commit applied first."""

    command: Any


@dataclasses.dataclass
class _CommitReady:
    command: Commit
    generation: int
    tail: np.ndarray


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
        self.plugin = plugin
        self.port = port
        self._emit_event = emit
        self.executor = executor
        self.pipeline = pipeline
        self.on_close = on_close
        self._mailbox: asyncio.Queue[Any] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self._tracked: set[asyncio.Task[None]] = set()
        self._tail: asyncio.Task[None] | None = None
        self.dropped_stale_outputs = 0

    # ------------------------------------------------------------ lifecycle

    def start(self, first_event: DuplexEvent) -> None:
        self.port.bind(self.session.session_id, self.on_stage_output)
        self.emit(first_event)
        self._worker = asyncio.create_task(
            self._run(), name=f"session-runner:{self.session.session_id}"
        )

    async def stop(self, reason: str) -> None:
        """Stop processing; a response still active ends with the cancelled chain."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._cancel_tracked()
        response = self.session.active
        if response is not None:
            self.finish(response, CANCELLED, reason)
            with contextlib.suppress(Exception):
                await self.port.abort([response.request_id])

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
            except (DuplexSessionError, RealtimeProtocolError, DuplexRuntimeConfigError) as exc:
                code, message = exc.code, exc.message
                self.error(code, message, getattr(exc, "related_event_id", None) or event_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug in one command must not kill the session
                log.exception("session %s: %s failed", self.session.session_id, type(item).__name__)
                self.error("internal_error", f"{type(item).__name__} failed: {exc}", event_id)

    async def _handle(self, item: Any) -> None:
        if isinstance(item, StageOutput):
            await self._stage_output(item)
        elif isinstance(item, _AppendReady):
            await self._append_ready(item)
        elif isinstance(item, _CommitReady):
            await self._commit_ready(item)
        elif isinstance(item, _InOrder):
            await handlers.handle(self, item.command, in_order=True)
        elif isinstance(item, Dispatched):
            self.session.lease.touch()
            await handlers.handle(self, item.command, item.reserved)
        else:
            self.session.lease.touch()
            await handlers.handle(self, item)

    # ------------------------------------------------------------ tracked tasks

    def _track(self, coro: Any, name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"{name}:{self.session.session_id}")
        self._tracked.add(task)
        task.add_done_callback(self._tracked.discard)
        self._tail = task
        return task

    def _cancel_tracked(self) -> None:
        for task in list(self._tracked):
            task.cancel()
        self._tail = None

    async def _after_tail(self, previous: asyncio.Task[None] | None) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait({previous})  # order only: the previous task's outcome is its own

    def schedule_append(self, command: AppendAudio, reserved: int) -> None:
        ready = _AppendReady(command, self.session.input_generation, reserved)
        self._track(self._append_work(ready, self._tail), "append")

    async def _append_work(self, ready: _AppendReady, previous: asyncio.Task[None] | None) -> None:
        delivered = False
        try:
            await self._after_tail(previous)
            if self._is_stale(ready.generation):
                return
            loop = asyncio.get_running_loop()
            silence_rms = self.session.config.overlap_silence_rms
            try:
                if self.pipeline.runs_inline(ready.command):
                    ready.result = self.pipeline.convert(ready.command, silence_rms)
                else:
                    ready.result = await loop.run_in_executor(
                        self.executor, self.pipeline.convert, ready.command, silence_rms
                    )
            except RealtimeProtocolError as exc:
                ready.error = exc
            self.submit(ready)
            delivered = True
        finally:
            if not delivered:  # stale or cancelled: roll back the reservation
                self._release(ready.generation, input_bytes=ready.reserved)

    def schedule_commit(self, command: Commit, *, reserved: bool = False) -> None:
        if not reserved:  # VAD commits are not dispatched, so nothing reserved them
            self.session.pending_commits += 1
        self._track(self._commit_work(command, self.session.input_generation, self._tail), "commit")

    async def _commit_work(
        self, command: Commit, generation: int, previous: asyncio.Task[None] | None
    ) -> None:
        delivered = False
        try:
            await self._after_tail(previous)
            if self._is_stale(generation):
                return
            tail = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.pipeline.flush
            )
            self.submit(_CommitReady(command, generation, tail))
            delivered = True
        finally:
            if not delivered:
                self._release(generation, commits=1)

    def schedule_in_order(self, command: Any) -> None:
        """Run `command` after the input work queued before it: response.create must
        see the turn committed just before it, input text must not join an earlier
        commit, a clear must not drop an earlier commit."""
        self._track(self._in_order_work(command, self._tail), "in-order")

    async def _in_order_work(self, command: Any, previous: asyncio.Task[None] | None) -> None:
        await self._after_tail(previous)  # the previous work has enqueued its result by now
        self.submit(_InOrder(command))

    def _is_stale(self, generation: int) -> bool:
        """Input work is fenced by the input generation, not the epoch (module docstring)."""
        return generation != self.session.input_generation

    def _release(self, generation: int, *, input_bytes: int = 0, commits: int = 0) -> None:
        """Give back a dispatch reservation. An input clear already zeroed the
        reservations of older generations, so theirs are not given back twice."""
        if generation == self.session.input_generation:
            self.session.pending_input_bytes -= input_bytes
            self.session.pending_commits -= commits

    # ------------------------------------------------------------ input

    async def _append_ready(self, ready: _AppendReady) -> None:
        session = self.session
        self._release(ready.generation, input_bytes=ready.reserved)
        if self._is_stale(ready.generation):
            return
        if ready.error is not None:
            raise ready.error.with_event_id(ready.command.event_id)
        result = ready.result
        assert result is not None
        start_ms = session.input.stream_ms
        session.input.append(result.samples)
        if not self.pipeline.has_vad and result.speech and session.input.speech_started_ms is None:
            self.speech_started(start_ms)
        if result.speech and session.active is not None and not self.pipeline.has_vad:
            self.report_overlap("listen", "listen_only")
        for event in result.vad_events:
            if event.kind == "started":
                session.input.trim_before(event.audio_ms)
                self.speech_started(event.audio_ms)
                if session.active is not None:
                    self.report_overlap("barge_in", "server_vad_utterance_active")
                    await self.advance_epoch("barge_in")
            else:
                self.speech_stopped(event.audio_ms)
                td = session.config.turn_detection
                if not session.model_native and td is not None:
                    self.schedule_commit(Commit(create_response=td.create_response))

    def speech_started(self, audio_start_ms: int) -> None:
        ledger = self.session.input
        ledger.speech_started_ms = audio_start_ms
        ledger.speech_stopped = False
        ledger.item_id = ledger.item_id or new_item_id()
        self.session.turn_state = "user_speaking"
        self.emit(
            InputAudioBufferSpeechStarted(audio_start_ms=audio_start_ms, item_id=ledger.item_id)
        )

    def speech_stopped(self, audio_end_ms: int) -> None:
        ledger = self.session.input
        ledger.speech_stopped = True
        ledger.item_id = ledger.item_id or new_item_id()
        self.emit(InputAudioBufferSpeechStopped(audio_end_ms=audio_end_ms, item_id=ledger.item_id))

    def report_overlap(self, action: str, reason: str) -> None:
        session, response = self.session, self.session.active
        if response is None or session.overlap_reported == response.response_id:
            return
        session.overlap_reported = response.response_id
        self.emit(
            OverlapDecision(
                session_id=session.session_id,
                epoch=session.epoch,
                policy=session.config.overlap_policy,
                action=action,
                reason=reason,
                metadata={"overlap_ms": response.playback.generated_ms},
            )
        )

    async def _commit_ready(self, ready: _CommitReady) -> None:
        self._release(ready.generation, commits=1)
        if self._is_stale(ready.generation):
            return
        self.session.input.append(ready.tail)
        transcript = None
        if self.plugin.transcribes and self.session.input.has_audio:
            # speech recognition is slow (pocketsphinx: ~0.1-0.4 of real time): it runs on the
            # executor; this session's mailbox waits, the worker's other sessions do not
            audio, rate = self.session.input.peek(), self.session.input.sample_rate_hz
            transcript = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.plugin.transcribe, audio, rate
            )
            if self._is_stale(ready.generation):
                return  # cancelled while recognising: the turn is gone
        turn = handlers.commit_turn(self, ready.command, transcript)
        if turn is None:
            return
        create = ready.command.create_response
        if create is None:
            td = self.session.config.turn_detection
            create = td is not None and td.create_response
        if create:
            await self.start_response(turn, ResponseCreateOptions(), ready.command.event_id)

    # ------------------------------------------------------------ responses

    async def advance_epoch(self, reason: str) -> None:
        """Cancel, barge-in, output clear, input cancel: one atomic step on the loop."""
        session = self.session
        session.epoch += 1
        response = session.active
        if response is not None:
            self.finish(response, CANCELLED, reason)
            session.turn_state = "barge_in" if reason == "barge_in" else "idle"
            await self.port.abort([response.request_id])

    async def start_response(
        self, turn: CommittedTurn, options: ResponseCreateOptions, event_id: str | None
    ) -> None:
        session = self.session
        if session.active is not None:
            await self.advance_epoch("new_response")
        if turn in session.pending_turns:
            session.pending_turns.remove(turn)
        session.unanswered_items = 0
        fence = dataclasses.replace(session.fence, turn_id=turn.turn_id)
        request_id = await self.port.ensure(fence, self.plugin.stage_roles[0])
        output_format = options.output_audio_format or session.config.output_audio_format
        response = ActiveResponse(
            response_id=new_response_id(),
            fence=fence,
            request_id=request_id,
            encoder=OutputAudioEncoder(output_format, self.plugin.output_sample_rate_hz),
            modalities=options.modalities or session.config.modalities,
        )
        session.active = response
        session.remember(response)
        session.turn_state = "assistant_generating"
        previous = session.conversation.add(response.item("in_progress", transcript=""))
        for event in start_events(response, previous):
            self.emit(event)
        plan = self.plugin.plan_response(
            ResponsePlanRequest(
                fence=fence,
                request_id=request_id,
                response_id=response.response_id,
                turn=turn,
                config=session.config,
                runtime_config=session.runtime_config,
                options=options,
                history=session.conversation.items,
            )
        )
        try:
            await self.port.submit_initial(plan)
        except Exception as exc:
            log.exception("session %s: stage submit failed", session.session_id)
            self.finish(response, FAILED, "runtime_data_plane_stream_failed")
            self.error("runtime_data_plane_stream_failed", f"stage submit failed: {exc}", event_id)

    async def _stage_output(self, raw: StageOutput) -> None:
        output = self.plugin.project(raw)
        response = self.session.active
        if output is None:
            return
        if (
            response is None
            or output.fence != response.fence
            or output.request_id != response.request_id
        ):
            self.dropped_stale_outputs += (
                1  # a late output of a cancelled epoch: consumed, never emitted
            )
            return
        if output.kind == "audio" and output.audio is not None:
            self.emit_audio(
                response, output.audio, output.sample_rate_hz, output.text, end_of_turn=False
            )
        elif output.kind == "done":
            tail = response.encoder.flush()
            if tail:
                self.emit_encoded(response, tail, "", end_of_turn=True)
            self.finish(response, COMPLETED, None)
        elif output.kind == "error":
            self.finish(response, FAILED, output.error_code or "runtime_data_plane_stream_failed")
            self.error(
                output.error_code or "runtime_data_plane_stream_failed",
                output.message or "stage failed",
            )

    def emit_audio(
        self,
        response: ActiveResponse,
        audio: np.ndarray,
        rate: int | None,
        text: str,
        *,
        end_of_turn: bool,
    ) -> None:
        if rate is not None and rate != self.plugin.output_sample_rate_hz:
            raise RuntimeError(
                f"stage audio at {rate} Hz, plugin declares {self.plugin.output_sample_rate_hz}"
            )
        self.emit_encoded(response, response.encoder.encode(audio), text, end_of_turn=end_of_turn)

    def emit_encoded(
        self, response: ActiveResponse, encoded: bytes, text: str, *, end_of_turn: bool
    ) -> None:
        session = self.session
        if not response.speaking:
            for event in speak_events(response, session.session_id):
                self.emit(event)
            session.turn_state = "assistant_playing"
            session.audio_started = True
        duration_ms = _duration_ms(encoded, response)
        for event in audio_events(
            response, session.session_id, b64encode_audio(encoded), text, duration_ms, end_of_turn
        ):
            self.emit(event)

    def finish(self, response: ActiveResponse, status: str, reason: str | None) -> None:
        """Close a response: history per the playback policy, then the terminal chain."""
        session = self.session
        response.reason = reason
        conversation = session.conversation
        history_item = None
        if status != FAILED:
            if status == CANCELLED:
                response.playback.committed_ms = min(
                    response.playback.committed_ms, response.playback.played_ms
                )
            elif session.config.playback_commit_policy != ACK_ONLY:
                response.playback.committed_ms = response.playback.generated_ms
            history_item = self.history_item(
                response, "completed" if status == COMPLETED else "incomplete"
            )
        previous = _previous_or_none(conversation, response.item_id)
        if history_item is None:
            conversation.discard(
                response.item_id
            )  # a failed response leaves no partial text in history
        for event in finish_events(response, status, history_item, previous):
            self.emit(event)
        if session.active is response:
            session.active = None
            session.last_response = response
            if session.turn_state != "barge_in":
                session.turn_state = "idle"

    def history_item(self, response: ActiveResponse, status: str) -> dict[str, Any]:
        """Write the response's committed text into its history item; return the item."""
        text = (
            response.transcript
            if response.playback.committed_ms >= response.playback.generated_ms
            else response.committed_text(response.playback.committed_ms)
        )
        item = response.item(status, transcript=text)
        with contextlib.suppress(DuplexSessionError):  # deleted by the client: nothing to update
            self.session.conversation.get(response.item_id).update(item)
        return item


def _duration_ms(encoded: bytes, response: ActiveResponse) -> float:
    encoding, rate = response.encoder.format.encoding, response.encoder.rate
    if encoding == "wav":
        return max(0, len(encoded) - 44) / 2 * 1000 / rate
    width = {"pcm16": 2, "pcm_f32le": 4}.get(encoding, 1)
    return len(encoded) / width * 1000 / rate


def _previous_or_none(conversation: Any, item_id: str) -> str | None:
    try:
        return conversation.previous_of(item_id)
    except DuplexSessionError:
        return None
