"""`ResponseController`: one session's responses, from start to their terminal chain.

Invariant: every method runs on the session's runner task (or in its `stop`, after that
task has ended), so it may write the `EngineSession` without a lock.

The response epoch fences the output stream: response.cancel, output_audio_buffer.clear,
barge_in, input.cancel, a new response over an active one and a response cut at its
max_output_tokens (the openai surface) advance it, which emits the terminal chain first
and then aborts the stage request, so nothing of the old epoch is emitted after its
terminal event: a stage output of an older fence or request still arriving is consumed
and dropped (`dropped_stale_outputs`).

A "nonfatal_error" stage output (a frame-clocked model's error of one frame) is an
`error` event and nothing else: the response in progress goes on.

What a stage output becomes: audio (and its transcript) in an audio response; the words
alone in a text response (`output_modalities: ["text"]`; any audio is dropped, and the
plugin was told not to make any: `ResponsePlanRequest.audio_output`); on the openai
surface, words past the response's max_output_tokens are cut and end it `incomplete`
(response.py); on the duplex surface the limit only reaches the plugin.

History follows the playback ledger (`ResponseHistory`, response_history.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from services.worker.engine import surface
from services.worker.engine.engine_session import EngineSession
from services.worker.engine.native_stream import NativeStream
from services.worker.engine.response import (
    CANCELLED,
    COMPLETED,
    FAILED,
    INCOMPLETE,
    MAX_OUTPUT_TOKENS,
    ActiveResponse,
    audio_events,
    created_event,
    finish_events,
    item_events,
    new_response_id,
    part_events,
    speak_event,
    take_words,
    text_events,
)
from services.worker.engine.response_history import ResponseHistory
from services.worker.engine.tool_calls import plan_tools, with_calls
from shared.contracts import (
    CommittedTurn,
    DuplexFence,
    DuplexModelPlugin,
    DuplexSessionError,
    OutputKind,
    ResponseCreateOptions,
    ResponsePlanRequest,
    StageOutput,
    StagePort,
)
from shared.errors import CodedError
from shared.protocol.duplex import (
    ACK_ONLY,
    DuplexErrorEvent,
    DuplexEvent,
    OutputAudioEncoder,
    OverlapDecision,
    b64encode_audio,
)
from shared.protocol.duplex.errors import INTERNAL_ERROR, STREAM_FAILED

log = logging.getLogger(__name__)

Emit = Callable[[DuplexEvent], None]


class ResponseController:
    def __init__(
        self, session: EngineSession, plugin: DuplexModelPlugin, port: StagePort, emit: Emit
    ) -> None:
        self.session = session
        self.plugin = plugin
        self.port = port
        self.emit = emit
        #: what history keeps of the responses, following the playback ledger
        self.history = ResponseHistory(session, emit)
        self.dropped_stale_outputs = 0
        #: a model-native stream (a frame-clocked plugin): its model starts the responses
        self.native: NativeStream | None = None

    # ------------------------------------------------------------ lifecycle

    async def start_response(
        self, turn: CommittedTurn, options: ResponseCreateOptions, event_id: str | None
    ) -> None:
        if self.native is not None:
            return  # a committed turn plans nothing: the model starts responses (native_stream)
        session = self.session
        if session.active is not None:
            if not _interrupts(session):
                return  # GA: with interrupt_response false a turn does not cut the response
            await self.advance_epoch("new_response")
        if turn in session.pending_turns:
            session.pending_turns.remove(turn)
        session.unanswered_items = 0
        fence = dataclasses.replace(session.fence, turn_id=turn.turn_id)
        request_id = await self.port.ensure(fence, self.plugin.stage_roles[0])
        response = self.begin(fence, request_id, options)
        tools, tool_choice = plan_tools(session.config, options)
        request = ResponsePlanRequest(
            fence=fence,
            request_id=request_id,
            response_id=response.response_id,
            turn=turn,
            config=session.config,
            runtime_config=session.runtime_config,
            options=options,
            history=session.conversation.items,
            tools=tools,
            tool_choice=tool_choice,
        )
        try:  # the plugin reads client text (history, tools): its failure fails this response
            plan = self.plugin.plan_response(request)
        except Exception as exc:
            log.exception("session %s: response planning failed", session.session_id)
            if isinstance(exc, CodedError):
                self.fail(response, exc.code, exc.message, event_id)
            else:
                self.fail(response, INTERNAL_ERROR, f"response planning failed: {exc}", event_id)
            return
        try:
            await self.port.submit_initial(plan)
        except Exception as exc:  # the engine's failure fails this response, not the session
            log.exception("session %s: stage submit failed", session.session_id)
            self.fail(response, STREAM_FAILED, f"stage submit failed: {exc}", event_id)

    def begin(
        self, fence: DuplexFence, request_id: str, options: ResponseCreateOptions
    ) -> ActiveResponse:
        """A response becomes the active one: response.created (and on the duplex surface
        its item). Planned to a turn (`start_response`) or opened by a model-native
        stream's first speaking frame (`response_for`)."""
        session = self.session
        openai = session.config.openai_surface
        output_format = options.output_audio_format or session.config.output_audio_format
        response = ActiveResponse(
            response_id=new_response_id(),
            fence=fence,
            request_id=request_id,
            encoder=OutputAudioEncoder(output_format, self.plugin.output_sample_rate_hz),
            modalities=options.output_modalities(session.config),
            metadata=surface.response_metadata(options) if openai else None,
            # the cut at max_output_tokens is GA's (the openai surface); on the duplex
            # surface the limit only reaches the plugin (an LLM's own), as before
            max_output_tokens=options.output_token_limit(session.config) if openai else None,
        )
        session.active = response
        session.remember(response)
        session.turn_state = "assistant_generating"
        self.emit(created_event(response))
        if not openai:
            self.announce(response)  # contract 1.2: the item opens with the response
            if not response.text_only:  # and its audio part (vLLM-Omni 0.30.0's order)
                for event in part_events(response):
                    self.emit(event)
        return response

    def announce(self, response: ActiveResponse) -> None:
        """The response's message item enters history and is announced: at the start on
        the duplex surface, at its first output on the openai surface (GA: a response
        that only calls a tool has no message item)."""
        session = self.session
        previous = session.conversation.add(response.item("in_progress", transcript=""))
        for event in item_events(response, previous, ga_order=session.config.openai_surface):
            self.emit(event)

    async def advance_epoch(self, reason: str) -> None:
        """Cancel, barge-in, output clear, input cancel: one atomic step on the loop."""
        session = self.session
        if reason == "barge_in" and not _interrupts(session):
            return  # speech over the response does not cancel it (interrupt_response false)
        session.epoch += 1
        response = session.active
        try:
            if response is not None:
                self.finish(response, CANCELLED, reason)
                session.turn_state = "barge_in" if reason == "barge_in" else "idle"
                await self.port.abort([response.request_id])
        finally:
            if self.native is not None:  # even when the abort failed: else the stream is mute
                await self.native.restamp()  # the model's next speech opens a new response

    async def speech_over_response(self) -> None:
        """Server VAD heard the user start speaking over the active response: a barge-in,
        except in a model-native stream, whose model hears the overlap and decides."""
        self.report_overlap("barge_in", "server_vad_utterance_active")
        if self.native is None:
            await self.advance_epoch("barge_in")

    async def stop_at_limit(self, response: ActiveResponse) -> None:
        """The response's words reached its max_output_tokens: it ends `incomplete` and its
        stage stops. The epoch advances as for a cancel: a later response to the same turn
        would reuse the stage request id, and nothing of this one may reach it."""
        self.session.epoch += 1
        self.finish(response, INCOMPLETE, MAX_OUTPUT_TOKENS)
        try:
            await self.port.abort([response.request_id])
        finally:
            if self.native is not None:
                await self.native.restamp()

    async def close(self, reason: str) -> None:
        """The session stops: a response still active ends with the cancelled chain."""
        response = self.session.active
        if response is None:
            return
        self.finish(response, CANCELLED, reason)
        try:
            await self.port.abort([response.request_id])
        except Exception:  # the session is closing: its stage cleanup aborts it again
            log.warning("session %s: abort at close failed", self.session.session_id, exc_info=True)

    def fail(
        self, response: ActiveResponse, code: str, message: str, event_id: str | None = None
    ) -> None:
        """The failure chain: response.done `failed` (its partial item leaves history),
        then the error event with `code`. A stage error, a failed plan or submit, and a
        response in flight on a worker that was lost (a restore) all end here."""
        self.finish(response, FAILED, code)
        self._error(code, message, event_id)

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
            history_item = self.history.history_item(
                response, "completed" if status == COMPLETED else "incomplete"
            )
        previous = _previous_or_none(conversation, response.item_id)
        if history_item is None:
            conversation.discard(response.item_id)  # a failed response leaves no partial text
        events = finish_events(response, status, history_item, previous)
        for event in with_calls(events, response, status, conversation):  # its tool calls
            self.emit(event)
        if session.active is response:
            session.active = None
            session.last_response = response
            if session.turn_state != "barge_in":
                session.turn_state = "idle"

    # ------------------------------------------------------------ stage output

    def response_for(self, output: StageOutput) -> ActiveResponse | None:
        """The response a stage output of a response's kind belongs to: the active one,
        or in a model-native session the one its speech opens; None (counted) for a late
        output of a cancelled epoch, never emitted."""
        response = self.session.active
        if response is None and self.native is not None and self.native.opens(output):
            # the model speaks: a model-native response opens on its stream's fence
            response = self.begin(output.fence, output.request_id, ResponseCreateOptions())
        if (
            response is None
            or output.fence != response.fence
            or output.request_id != response.request_id
        ):
            self.dropped_stale_outputs += 1
            return None
        return response

    async def on_speech(self, response: ActiveResponse, output: StageOutput) -> None:
        """Audio and words (an AUDIO or TEXT output) of the response."""
        text, over = take_words(response, output.text)
        if output.kind is OutputKind.AUDIO and output.audio is not None and not response.text_only:
            self.emit_audio(response, output.audio, output.sample_rate_hz, text, end_of_turn=False)
        elif text:  # a text response's words (its audio, if any, dropped), or words alone
            self.emit_words(response, text)
        if over:
            await self.stop_at_limit(response)

    def complete(self, response: ActiveResponse) -> None:
        """The stage's request is over (DONE; LISTEN in a model-native stream)."""
        tail = b"" if response.text_only else response.encoder.flush()
        if tail:
            self.emit_encoded(response, tail, "", end_of_turn=True)
        self.finish(response, COMPLETED, None)

    def stage_failed(self, response: ActiveResponse, output: StageOutput) -> None:
        self.fail(response, output.error_code or STREAM_FAILED, output.message or "stage failed")

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
        session.turn_state = "assistant_playing"  # the response's audio is being sent
        session.audio_started = True
        self._open_part(response)
        duration_ms = _duration_ms(encoded, response)
        for event in audio_events(
            response,
            session.session_id,
            b64encode_audio(encoded),
            text,
            duration_ms,
            end_of_turn,
            ga=session.config.openai_surface,
        ):
            self.emit(event)

    def emit_words(self, response: ActiveResponse, text: str) -> None:
        """Words without audio (response.py `text_events`)."""
        self._open_part(response)
        for event in text_events(response, text):
            self.emit(event)

    def _open_part(self, response: ActiveResponse) -> None:
        """Before the response's first output: its item (if not yet announced), its part
        (if not yet open), and on the duplex surface `response.speak`."""
        if not response.announced:
            self.announce(response)
        if not response.speaking:
            for event in part_events(response):
                self.emit(event)
        if not response.spoke:
            response.spoke = True
            if not response.text_only and not self.session.config.openai_surface:
                self.emit(speak_event(response, self.session.session_id))

    def report_overlap(self, action: str, reason: str) -> None:
        """The user spoke over the active response: said once per response."""
        session, response = self.session, self.session.active
        if response is None or session.overlap_reported == response.response_id:
            return
        if self.native is not None:  # the model hears the overlap and decides, never a cancel
            action, reason = "listen", "model_native"
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

    def nonfatal_error(self, output: StageOutput) -> None:
        """A stage's error that fails nothing (a frame-clocked model's `FrameOutput.error`):
        an `error` event, unless it is of a cancelled epoch (stale, as its outputs are)."""
        fence, session = output.fence, self.session
        if fence is None or fence.session_id != session.session_id or fence.epoch != session.epoch:
            self.dropped_stale_outputs += 1
            return
        self._error(output.error_code or STREAM_FAILED, output.message or "stage error")

    def _error(self, code: str, message: str, related_event_id: str | None = None) -> None:
        self.emit(DuplexErrorEvent.for_code(code, message, related_event_id=related_event_id))


def _interrupts(session: EngineSession) -> bool:
    """Whether user speech cancels the active response: always, unless turn detection
    says `interrupt_response: false` (accepted on the openai surface only)."""
    td = session.config.turn_detection
    return td is None or td.interrupt_response


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
