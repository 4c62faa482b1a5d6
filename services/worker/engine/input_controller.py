"""`InputController`: the user's side of a session: appends (a model-native stream's fed
to its model as applied: native_stream.py), server VAD, speech, the commit of a turn.

Invariant: every method here runs on the session's runner task (or in its `stop`, after
that task has ended); it is the only code that writes the input ledger and the input
budget. The slow half of each append and commit (decode, resample, VAD, the resampler
flush) runs in the session's one input task (`InputQueue`), which writes nothing: its
results come back through the runner's mailbox and are applied by `on_append_ready` and
`on_commit_ready`, in the order the work was queued.

The input generation fences input work: input.cancel advances it (`drop_in_flight`),
dropping appends and commits still in flight. A barge-in does NOT: the speech that
interrupted the model is the user's next turn. input_audio_buffer.clear runs in input
order instead, so what was appended before it is applied, then cleared.

Every reservation the manager made at dispatch (an append's decoded bytes, one pending
commit) is given back once: when its result is applied or dropped here, by the
input.cancel that zeroes its generation's, or by `stop` for work never delivered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor

import numpy as np

from services.worker.engine.command_marks import NO_MARK, CommandTicket
from services.worker.engine.engine_session import EngineSession, new_item_id
from services.worker.engine.idle_timeout import IdleDue, IdleTimer
from services.worker.engine.input_pipeline import InputPipeline
from services.worker.engine.input_queue import (
    AppendReady,
    AppendWork,
    CommitReady,
    CommitWork,
    InOrder,
    InputQueue,
    Ready,
)
from services.worker.engine.native_surfaces import usage_due, usage_event
from services.worker.engine.response_controller import ResponseController
from services.worker.engine.semantic_turn import TurnHint, classify
from services.worker.engine.transcription import (
    PartialTranscriber,
    PartialTranscript,
    is_semantic,
    transcript_events,
)
from shared.contracts import (
    CommittedTurn,
    DuplexModelPlugin,
    DuplexSessionError,
    ResponseCreateOptions,
    TurnDetection,
)
from shared.protocol.duplex import (
    AppendAudio,
    Commit,
    ConversationItemAdded,
    ConversationItemCreated,
    ConversationItemDone,
    DuplexCommand,
    DuplexEvent,
    DuplexInputAudioBufferCommitted,
    InputAudioBufferSpeechStarted,
    InputAudioBufferSpeechStopped,
    InputAudioBufferTimeoutTriggered,
    ResponseListen,
)

log = logging.getLogger(__name__)

#: Committed turns kept for a later response.create (the latest is answered).
MAX_UNANSWERED_TURNS = 4


class InputController:
    def __init__(
        self,
        session: EngineSession,
        plugin: DuplexModelPlugin,
        pipeline: InputPipeline,
        executor: Executor,
        responses: ResponseController,
        emit: Callable[[DuplexEvent], None],
        deliver: Callable[[Ready], None],
    ) -> None:
        self.session = session
        self.plugin = plugin
        self.pipeline = pipeline
        self.executor = executor
        self.responses = responses
        self.emit = emit
        self.queue = InputQueue(session, pipeline, executor, deliver)
        #: partial transcripts while the user speaks (`transcription.py`)
        self.partials = PartialTranscriber(session, plugin, executor, deliver, emit)
        #: turn detection's idle_timeout_ms (`idle_timeout.py`)
        self.idle = IdleTimer(session, deliver)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.queue.start()

    async def stop(self) -> None:
        """Stop the input task and timers; give back what unfinished work had reserved."""
        await self.partials.stop()
        await self.idle.stop()
        for work in await self.queue.stop():
            if isinstance(work, AppendWork):
                self.release(work.generation, input_bytes=work.reserved)
            elif isinstance(work, CommitWork):
                self.release(work.generation, commits=1)

    # ------------------------------------------------------------ scheduling

    def schedule_append(
        self, command: AppendAudio, ticket: CommandTicket, images: tuple[bytes, ...] = ()
    ) -> None:
        """`images`: the append's camera frames, decoded and checked for a model-native
        stream's model (`NativeStream.camera_frames`); they go with its audio."""
        generation = self.session.input_generation
        mark = ticket.defer()
        self.queue.put(AppendWork(command, generation, ticket.reserved, mark, images))

    def schedule_commit(self, command: Commit, ticket: CommandTicket | None = None) -> None:
        """`ticket`: the client's commit, dispatched with its pending turn reserved; None: a
        commit of the session's own (server VAD, idle timeout), which nothing reserved."""
        if ticket is None or not ticket.reserved:
            self.session.pending_commits += 1
        mark = ticket.defer() if ticket is not None else NO_MARK
        self.queue.put(CommitWork(command, self.session.input_generation, mark))

    def schedule_in_order(self, command: DuplexCommand, ticket: CommandTicket) -> None:
        """Run `command` after the input work queued before it: response.create must see the
        turn committed just before it, text not join an earlier commit, a clear not drop one."""
        self.queue.put(InOrder(command, ticket.defer()))

    def is_stale(self, generation: int) -> bool:
        return generation != self.session.input_generation

    def release(self, generation: int, *, input_bytes: int = 0, commits: int = 0) -> None:
        """Give back a dispatch reservation. An input cancel already zeroed the
        reservations of older generations, so theirs are not given back twice."""
        if generation == self.session.input_generation:
            self.session.pending_input_bytes -= input_bytes
            self.session.pending_commits -= commits

    # ------------------------------------------------------------ results of the input task

    async def on_append_ready(self, ready: AppendReady) -> None:
        session = self.session
        self.release(ready.generation, input_bytes=ready.reserved)
        if self.is_stale(ready.generation) or ready.failed:
            return
        if ready.error is not None:
            raise ready.error.with_event_id(ready.command.event_id)
        result = ready.result
        assert result is not None
        start_ms = session.input.stream_ms
        if session.input.first_mark is None and ready.mark != NO_MARK and result.samples.size:
            session.input.first_mark = ready.mark
        samples = result.samples
        if session.surface_state.muted:  # GPT-Live's mute: the model hears silence, and so
            samples = np.zeros_like(samples)  # does everything after (nothing keeps the audio)
        session.input.append(samples)
        if self.responses.native is not None:
            self.responses.native.feed(samples, ready.images)
        if usage_due(session):
            self.emit(usage_event(session.input.stream_ms))
        if not self.pipeline.has_vad and result.speech and session.input.speech_started_ms is None:
            self.speech_started(start_ms)
        if result.speech and session.active is not None and not self.pipeline.has_vad:
            self.responses.report_overlap("listen", "listen_only")
        for event in result.vad_events:
            if event.kind == "paused":  # semantic_vad: the verdict needs the words so far
                self.partials.on_pause()
            elif event.kind == "started":
                session.input.trim_before(event.audio_ms)
                self.speech_started(event.audio_ms)
                if session.active is not None:
                    await self.responses.speech_over_response()
            else:
                self.speech_stopped(event.audio_ms)
                td = session.config.turn_detection
                if not session.model_native and td is not None:
                    self.schedule_commit(Commit(create_response=td.create_response))
        self.partials.on_audio()
        if self.idle.due_by_audio():
            await self.idle_timeout()

    async def on_commit_ready(self, ready: CommitReady) -> None:
        self.release(ready.generation, commits=1)
        if self.is_stale(ready.generation) or ready.failed:
            return
        self.session.input.append(ready.tail)
        transcript, failure = None, None
        if self.plugin.transcribes and self.session.input.has_audio:
            # speech recognition is slow (pocketsphinx: ~0.1-0.4 of real time): it runs on the
            # executor; this session's mailbox waits, the worker's other sessions do not
            audio, rate = self.session.input.peek(), self.session.input.sample_rate_hz
            try:
                transcript = await asyncio.get_running_loop().run_in_executor(
                    self.executor, self.plugin.transcribe, audio, rate
                )
            except Exception as exc:  # the turn is committed without it (`.failed`)
                log.warning(
                    "session %s: transcription failed", self.session.session_id, exc_info=True
                )
                failure = exc
            if self.is_stale(ready.generation):
                return  # cancelled while recognising: the turn is gone
        turn = self.commit_turn(ready.command, transcript, failure)
        if turn is None:
            return
        create = ready.command.create_response
        if self.session.config.auto_responds:
            create = True  # even `create_response: false` (vLLM-Omni's barge_in_client)
        elif create is None:
            td = self.session.config.turn_detection
            create = td is not None and td.create_response
        if create:
            await self.responses.start_response(
                turn, ResponseCreateOptions(), ready.command.event_id
            )

    # ------------------------------------------------------------ speech and turns

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

    def commit_turn(
        self,
        command: Commit,
        transcript: str | None = None,
        failure: BaseException | None = None,
        *,
        allow_empty: bool = False,
    ) -> CommittedTurn | None:
        """The commit fan-out: speech_stopped -> item added -> item created -> committed
        -> (transcription completed or failed) -> item done. Returns the committed turn, or
        None. `transcript`: what the plugin's speech recogniser heard
        (`DuplexModelPlugin.transcribe`); `failure`: what it raised instead.
        `allow_empty`: an idle timeout commits an audio item even with no audio."""
        session, ledger = self.session, self.session.input
        if command.is_speech is False:  # the client declares silence: no turn, no response
            ledger.clear()
            item_id = new_item_id()
            self.emit(
                DuplexInputAudioBufferCommitted(
                    previous_item_id=session.conversation.last_id(),
                    item_id=item_id,
                    event=self._committed_event(item_id, empty=True, no_response=True),
                )
            )
            self.emit(
                ResponseListen(
                    session_id=session.session_id,
                    epoch=session.epoch,
                    response={
                        "object": "realtime.response",
                        "status": "listening",
                        "metadata": {"reason": "silence_or_noise"},
                    },
                )
            )
            return None
        if not ledger.has_audio and not ledger.text and not allow_empty:
            raise DuplexSessionError(
                "input_audio_buffer_empty",
                "commit without audio",
                related_event_id=command.event_id,
            )
        item_id = ledger.item_id or new_item_id()
        if ledger.speech_started_ms is not None and not ledger.speech_stopped:
            self.speech_stopped(ledger.stream_ms)
        text = ledger.text
        audio = ledger.take()
        session.turn_id += 1
        session.turn_state = "user_committed"
        content = [{"type": "input_audio", "transcript": None}] if audio.size or allow_empty else []
        if text:
            content.append({"type": "input_text", "text": text})
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": content,
        }
        previous = session.conversation.add(item)
        turn = CommittedTurn(session.turn_id, item_id, audio, ledger.sample_rate_hz, text)
        turn.transcript = transcript
        if transcript is not None and content:
            content[0]["transcript"] = transcript
        self.emit(ConversationItemAdded(previous_item_id=previous, item=item))
        self.emit(ConversationItemCreated(previous_item_id=previous, item=item))
        self.emit(
            DuplexInputAudioBufferCommitted(
                previous_item_id=previous,
                item_id=item_id,
                event=self._committed_event(item_id, empty=False, no_response=False),
            )
        )
        if audio.size:
            seconds = audio.size / ledger.sample_rate_hz
            for event in transcript_events(session.config, item_id, transcript, failure, seconds):
                self.emit(event)
        self.emit(ConversationItemDone(previous_item_id=previous, item=item))
        if self.responses.native is not None:
            return turn  # never answered by a response.create: its audio is not kept
        session.pending_turns.append(turn)
        while len(session.pending_turns) > MAX_UNANSWERED_TURNS:
            session.pending_turns.popleft()  # response.create answers the latest turn
        return turn

    def _committed_event(self, item_id: str, *, empty: bool, no_response: bool) -> dict:
        session = self.session
        return {
            "type": "input.committed",
            "turn_id": session.turn_id,
            "epoch": session.epoch,
            "history_len": len(session.conversation),
            "realtime_item_id": item_id,
            "empty": empty,
            "no_response": no_response,
        }

    # ------------------------------------------------------------ text, clear, cancel, VAD

    def append_text(self, text: str) -> None:
        self.session.input.text += text

    def reset(self) -> None:
        """Drop the buffered turn; the resampler and VAD start over at the stream's end."""
        self.session.input.clear()
        self.partials.reset()
        self.pipeline.reset(self.session.input.stream_ms)

    def reserve_again(self, command: DuplexCommand, reserved: int) -> None:
        """The manager reserved for `command` at submit, after an input.cancel still ahead
        of it in the mailbox; that cancel zeroed the reservation. The command is newer than
        the cancel and goes on: take its reservation again, so the release that comes
        with its result subtracts what is there (the budget never goes below zero)."""
        if isinstance(command, Commit):
            self.session.pending_commits += reserved
        else:
            self.session.pending_input_bytes += reserved

    def drop_in_flight(self) -> None:
        """input.cancel: appends and commits in flight from before are dropped, and their
        reservations with them (module docstring)."""
        session = self.session
        session.input_generation += 1
        session.pending_input_bytes = session.pending_commits = 0

    def configure_vad(self, settings: TurnDetection | None) -> None:
        self.pipeline.configure_vad(settings, self.session.input.stream_ms)

    # ------------------------------------------------------------ partials and idle timeout

    def observe(self, event: DuplexEvent) -> None:
        """Every event the session emits (the runner's `emit`): the idle timer's cues."""
        self.idle.observe(event)

    def on_partial(self, result: PartialTranscript) -> None:
        """A partial decode came back: its delta, and semantic_vad's verdict."""
        text = self.partials.apply(result)
        if text is not None and is_semantic(self.session.config):
            self.pipeline.set_turn_hint(TurnHint(classify(text), result.covers_ms))

    async def on_idle_due(self, due: IdleDue) -> None:
        if self.idle.due_by_wall(due):
            await self.idle_timeout()

    async def idle_timeout(self) -> None:
        """idle_timeout_ms passed in silence (`idle_timeout.py`): timeout_triggered, the
        silent audio since the playback ended committed, and a response to it."""
        session, ledger = self.session, self.session.input
        span = self.idle.fire()
        if span is None:
            return  # the user or the client acted meanwhile: theirs is the next turn
        ledger.trim_before(span.audio_start_ms)
        ledger.item_id = ledger.item_id or new_item_id()
        self.emit(
            InputAudioBufferTimeoutTriggered(
                audio_start_ms=span.audio_start_ms,
                audio_end_ms=span.audio_end_ms,
                item_id=ledger.item_id,
            )
        )
        td = session.config.turn_detection
        create = td is not None and td.create_response
        turn = self.commit_turn(Commit(create_response=create), allow_empty=True)
        if turn is not None and create:
            await self.responses.start_response(turn, ResponseCreateOptions(), None)
