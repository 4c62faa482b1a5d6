"""What each client command does to a session: `HANDLERS`, a table from command class to
handler, and `dispatch`, its one entry point.

Invariant: handlers run on the session's runner task, one command at a time, and reach
the session only through a `SessionContext`: its state and the two controllers that own
its input (`InputController`) and its responses (`ResponseController`). This module
never sees the runner; the runner calls `dispatch`, never the other way round.

Commands that act on the input stream (`IN_INPUT_ORDER`) do not run when dispatched:
they queue behind the appends and commits sent before them and come back as `InOrder`
items, so response.create answers the turn committed just before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import assert_never

import numpy as np

from services.worker.engine.command_marks import CommandTicket
from services.worker.engine.engine_session import EngineSession, new_item_id
from services.worker.engine.input_controller import InputController
from services.worker.engine.native_stream import refuse_response_create
from services.worker.engine.native_surfaces import muted_event, ready_event
from services.worker.engine.response_controller import ResponseController
from services.worker.engine.tool_calls import (
    check_item,
    check_response_tools,
    hold_call,
    tool_output_turn,
)
from shared.contracts import (
    CommittedTurn,
    DuplexModelPlugin,
    DuplexSessionError,
    OutputKind,
    ResponseCreateOptions,
    StageOutput,
)
from shared.protocol.duplex import (
    AckPlayback,
    AppendAudio,
    AppendText,
    BargeIn,
    CancelInput,
    CancelResponse,
    ClearInput,
    ClearOutputAudio,
    CloseSession,
    Commit,
    ConversationItemAdded,
    ConversationItemCreated,
    ConversationItemDone,
    ConversationItemRetrieved,
    CreateItem,
    CreateResponse,
    DeleteItem,
    DuplexCommand,
    DuplexConversationItemDeleted,
    DuplexErrorEvent,
    DuplexEvent,
    Heartbeat,
    InputAudioBufferCleared,
    MuteInput,
    OutputAudioBufferCleared,
    SessionHeartbeatAck,
    SessionUpdated,
    SignalTurn,
    TruncateItem,
    TurnEvent,
    UpdateSession,
)
from shared.protocol.duplex.errors import WORKER_LOST


@dataclasses.dataclass
class SessionContext:
    """What a handler may touch. `on_close(session_id, reason)` asks the manager to close
    the session from outside its runner (closing stops the runner)."""

    session: EngineSession
    plugin: DuplexModelPlugin
    input: InputController
    responses: ResponseController
    emit: Callable[[DuplexEvent], None]
    on_close: Callable[[str, str], None] | None = None


#: A handler gets its command and the command's ticket (`command_marks.CommandTicket`):
#: what the manager reserved at dispatch (input bytes for an append, a pending commit for a
#: commit, 0 for the rest) and the mark that input work takes when it completes the command.
Handler = Callable[..., Awaitable[None]]

#: commands that act on the input stream: they wait for the appends and commits sent before them
#: (a mute silences the appends sent after it, never one sent before)
IN_INPUT_ORDER = (CreateResponse, AppendText, ClearInput, MuteInput)


async def on_stage_output(ctx: SessionContext, raw: StageOutput) -> None:
    """A stage output, by its kind (`OutputKind`): the one place each is handled."""
    output = ctx.plugin.project(raw)
    if output is None:
        return
    responses, native = ctx.responses, ctx.responses.native
    match output.kind:
        case OutputKind.READY:
            # the slot stepped its prompt: Moshi's handshake, GPT-Live's session.started
            if native is not None and native.owns(output) and ctx.session.config.native_surface:
                ctx.emit(ready_event())
        case OutputKind.QUIET:
            # a frame the model stepped while listening, of a client-clocked session: its
            # protocol (Moshi's) sends every frame, silence included
            if native is not None and native.owns(output):
                ctx.emit(native.quiet_frame(output))
        case OutputKind.NONFATAL_ERROR:
            responses.nonfatal_error(output)
        case OutputKind.ERROR if native is not None and native.lost(output):
            # the model's slot could not be rebuilt from its history: nothing left to
            # serve. The session's error (its response's failure chain, if one was going
            # on), then it closes
            code, message = output.error_code or WORKER_LOST, output.message or "stream lost"
            if ctx.session.active is not None:
                responses.fail(ctx.session.active, code, message)
            else:
                ctx.emit(DuplexErrorEvent.for_code(code, message))
            if ctx.on_close is not None:
                ctx.on_close(ctx.session.session_id, code)
        case OutputKind.AUDIO | OutputKind.TEXT:
            if (response := responses.response_for(output)) is not None:
                await responses.on_speech(response, output)
        case OutputKind.FUNCTION_CALL:
            if (response := responses.response_for(output)) is not None:
                hold_call(response, output.function_call)  # emitted when the response completes
        case OutputKind.DONE:
            if (response := responses.response_for(output)) is not None:
                responses.complete(response)
        case OutputKind.LISTEN:
            # a model-native stream's response ends when its model listens again; a turn
            # stage's listen says only that it did not speak (its DONE follows)
            if native is not None and (response := responses.response_for(output)) is not None:
                responses.complete(response)
        case OutputKind.ERROR:
            if (response := responses.response_for(output)) is not None:
                responses.stage_failed(response, output)
        case _:
            assert_never(output.kind)


async def dispatch(
    ctx: SessionContext,
    command: DuplexCommand,
    ticket: CommandTicket | None = None,
    *,
    in_order: bool = False,
) -> None:
    """Run one command; `in_order`: it has come back from the input queue (module head)."""
    ticket = ticket or CommandTicket()
    handler = HANDLERS.get(type(command))
    if handler is None:
        raise DuplexSessionError("unknown_event", f"{command.wire_type} is not a session command")
    if isinstance(command, IN_INPUT_ORDER) and not in_order:
        ctx.input.schedule_in_order(command, ticket)
        return
    await handler(ctx, command, ticket)


# ---------------------------------------------------------------- input


async def _append(ctx: SessionContext, command: AppendAudio, ticket: CommandTicket) -> None:
    if not command.audio and (
        not command.video_frames or not ctx.session.capabilities.allows_video_without_audio
    ):
        # never scheduled: what the manager reserved for it comes back here, or the
        # session stays busy (never idle-expires) with a budget that shrank for good
        ctx.input.release(ctx.session.input_generation, input_bytes=ticket.reserved)
        if command.video_frames:
            raise DuplexSessionError(
                "invalid_video_frames", "this model needs audio with every video frame"
            )
        return  # an empty append is a no-op
    images: tuple[bytes, ...] = ()
    if command.video_frames and (native := ctx.responses.native) is not None:
        # checked before anything of the append is applied: a bad one is refused whole
        try:
            images = native.camera_frames(command.video_frames)
        except DuplexSessionError:
            ctx.input.release(ctx.session.input_generation, input_bytes=ticket.reserved)
            raise
    ctx.input.schedule_append(command, ticket, images)


async def _append_text(ctx: SessionContext, command: AppendText, ticket: CommandTicket) -> None:
    if ctx.session.model_native:
        raise DuplexSessionError(
            "native_text_append_unsupported", "a model-native session takes audio only"
        )
    ctx.input.append_text(command.text)


async def _commit(ctx: SessionContext, command: Commit, ticket: CommandTicket) -> None:
    ctx.input.schedule_commit(command, ticket)


async def _clear_input(ctx: SessionContext, command: ClearInput, ticket: CommandTicket) -> None:
    """Runs in input order: what was appended before it is applied, then dropped."""
    ctx.input.reset()
    ctx.emit(InputAudioBufferCleared())


async def _cancel_input(ctx: SessionContext, command: CancelInput, ticket: CommandTicket) -> None:
    """Runs at once: input still in flight is dropped, not waited for."""
    ctx.input.drop_in_flight()
    ctx.input.reset()
    await ctx.responses.advance_epoch("input_cancelled")
    ctx.emit(InputAudioBufferCleared())


# ---------------------------------------------------------------- responses


async def _create_response(
    ctx: SessionContext, command: CreateResponse, ticket: CommandTicket
) -> None:
    session = ctx.session
    openai = session.config.openai_surface
    options = ResponseCreateOptions.from_realtime(
        command.options,
        private_keys=ctx.plugin.private_runtime_config_keys,
        openai_surface=openai,
    )
    if ctx.responses.native is not None:
        raise refuse_response_create()  # the model decides when it speaks (native_stream.py)
    if session.model_native:
        options.check_native()
    check_response_tools(options)
    if session.active is not None:
        active = session.active.response_id
        if openai:  # GA's code: Pipecat ignores it, and treats any other error as fatal
            raise DuplexSessionError(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: {active}. "
                "Wait until the response is finished before creating a new one.",
            )
        raise DuplexSessionError("response_already_active", f"response {active} is active")
    turn = session.pending_turns[-1] if session.pending_turns else None
    if turn is None:
        # after the client's function_call_output: answer it, with no new audio turn
        turn = tool_output_turn(session, ctx.plugin.input_sample_rate_hz)
    if turn is None and openai:
        # GA answers from the conversation: the client's user text, or nothing at all
        turn = conversation_turn(session, ctx.plugin.input_sample_rate_hz)
    if turn is None:
        if session.unanswered_items:
            session.unanswered_items = 0  # the refusal consumes the items
            raise DuplexSessionError(
                "text_only_turn_unsupported", "this model answers committed audio, not items"
            )
        raise DuplexSessionError(
            "response_create_without_input", "commit audio before response.create"
        )
    await ctx.responses.start_response(turn, options, command.event_id)


async def _cancel_response(
    ctx: SessionContext, command: CancelResponse, ticket: CommandTicket
) -> None:
    active = ctx.session.active
    if active is None or (
        command.response_id is not None and command.response_id != active.response_id
    ):
        if ctx.session.config.openai_surface:
            # GA's code and message: Pipecat ignores this code (any other error is fatal to
            # it), LiveKit skips errors whose message starts with "Cancellation failed"
            raise DuplexSessionError(
                "response_cancel_not_active", "Cancellation failed: no active response found"
            )
        raise DuplexSessionError("response_not_active", "no active response to cancel")
    await ctx.responses.advance_epoch("client_cancelled")


def conversation_turn(session: EngineSession, sample_rate_hz: int) -> CommittedTurn:
    """The input of an openai-surface `response.create` with no committed audio: a turn
    without audio whose text is what the client's user items said since the last response
    (their `input_text` parts, and the transcripts of `input_audio` ones), "" if none."""
    users = [item for item in session.conversation.items if item.get("role") == "user"]
    pending = users[len(users) - session.unanswered_items :] if session.unanswered_items else []
    said = [
        str(part.get("text") or part.get("transcript") or "").strip()
        for item in pending
        for part in item.get("content") or []
        if isinstance(part, dict) and part.get("type") in ("input_text", "input_audio")
    ]
    anchor = pending[-1]["id"] if pending else session.conversation.last_id()
    return CommittedTurn(
        session.turn_id,
        str(anchor or ""),
        np.zeros(0, np.float32),
        sample_rate_hz,
        " ".join(words for words in said if words),
    )


async def _clear_output(
    ctx: SessionContext, command: ClearOutputAudio, ticket: CommandTicket
) -> None:
    session = ctx.session
    active, last = session.active, session.last_response
    target = command.response_id
    if target is None and (active or last) is not None:
        target = (active or last).response_id
    if target is None:
        raise DuplexSessionError("response_not_active", "no response to clear")
    if active is not None and active.response_id == target:
        await ctx.responses.advance_epoch("client_cancelled")
    elif target not in session.responses:
        raise DuplexSessionError("response_not_active", f"unknown response {target!r}")
    ctx.emit(OutputAudioBufferCleared(response_id=target))


async def _barge_in(ctx: SessionContext, command: BargeIn, ticket: CommandTicket) -> None:
    if not ctx.session.capabilities.supports_barge_in:
        raise DuplexSessionError("barge_in_unsupported", "this model does not support barge-in")
    await ctx.responses.advance_epoch("barge_in")


async def _ack_playback(ctx: SessionContext, command: AckPlayback, ticket: CommandTicket) -> None:
    ctx.responses.history.acknowledge_playback(command)


async def _truncate_item(ctx: SessionContext, command: TruncateItem, ticket: CommandTicket) -> None:
    ctx.responses.history.truncate_item(command)


# ---------------------------------------------------------------- session and conversation


async def _update(ctx: SessionContext, command: UpdateSession, ticket: CommandTicket) -> None:
    session = ctx.session
    updated = session.config.apply_update(command.patch)
    if updated.voice != session.config.voice and session.audio_started:
        raise DuplexSessionError(
            "voice_update_after_audio_unsupported", "the voice is fixed once audio started"
        )
    ctx.plugin.validate_client_extra_body(updated.extra_body)
    session.runtime_config = ctx.plugin.runtime_config_for_update(session.runtime_config, updated)
    ctx.input.configure_vad(updated.turn_detection)
    session.config = updated
    ctx.emit(SessionUpdated(session=session.session_object()))


async def _close(ctx: SessionContext, command: CloseSession, ticket: CommandTicket) -> None:
    """Commands queued before the close have run; the manager closes the session."""
    if ctx.on_close is not None:
        ctx.on_close(ctx.session.session_id, command.reason)


async def _heartbeat(ctx: SessionContext, command: Heartbeat, ticket: CommandTicket) -> None:
    ctx.emit(SessionHeartbeatAck(session_id=ctx.session.session_id))


async def _create_item(ctx: SessionContext, command: CreateItem, ticket: CommandTicket) -> None:
    conversation = ctx.session.conversation
    item = dict(command.item)
    item.setdefault("id", new_item_id())
    item.setdefault("status", "completed")
    if any(existing.get("id") == item["id"] for existing in conversation.items):
        raise DuplexSessionError("bad_event", f"item {item['id']!r} already exists")
    check_item(conversation, item)  # function_call_output: a known call, answered once
    previous = conversation.add(item, command.previous_item_id)
    if item.get("role") == "user":
        ctx.session.unanswered_items += 1
    for event_type in (ConversationItemAdded, ConversationItemCreated, ConversationItemDone):
        ctx.emit(event_type(previous_item_id=previous, item=item))
    native = ctx.responses.native
    if native is not None and item.get("type") == "function_call_output":
        # a model-native session: the output goes to the model, which speaks about it when
        # it will (response.create stays refused: native_stream.py)
        call = conversation.function_call(str(item["call_id"])) or {}
        await native.function_output(
            str(item["call_id"]), str(call.get("name") or ""), str(item.get("output") or "")
        )


async def _delete_item(ctx: SessionContext, command: DeleteItem, ticket: CommandTicket) -> None:
    ctx.session.conversation.delete(command.item_id)
    ctx.emit(DuplexConversationItemDeleted(item_id=command.item_id, event=command.to_dict()))


async def _signal(ctx: SessionContext, command: SignalTurn, ticket: CommandTicket) -> None:
    session = ctx.session
    if command.event == "conversation.item.retrieve":
        item_id = command.payload.get("item_id")
        ctx.emit(ConversationItemRetrieved(item=session.conversation.get(str(item_id))))
        return
    ctx.emit(
        TurnEvent(
            session_id=session.session_id,
            event=command.event,
            turn_state=session.turn_state,
            epoch=session.epoch,
        )
    )


async def _mute(ctx: SessionContext, command: MuteInput, ticket: CommandTicket) -> None:
    """GPT-Live's mute: the appends applied from now on reach the model as silence
    (`InputController.on_append_ready`); the flag moves with the session (its checkpoint)."""
    ctx.session.surface_state.muted = command.muted
    if ctx.session.config.native_surface:
        ctx.emit(muted_event(command.muted, command.event_id))


HANDLERS: dict[type[DuplexCommand], Handler] = {
    AppendAudio: _append,
    AppendText: _append_text,
    Commit: _commit,
    ClearInput: _clear_input,
    CancelInput: _cancel_input,
    CreateResponse: _create_response,
    CancelResponse: _cancel_response,
    ClearOutputAudio: _clear_output,
    BargeIn: _barge_in,
    AckPlayback: _ack_playback,
    TruncateItem: _truncate_item,
    UpdateSession: _update,
    Heartbeat: _heartbeat,
    CloseSession: _close,
    CreateItem: _create_item,
    DeleteItem: _delete_item,
    SignalTurn: _signal,
    MuteInput: _mute,
}
