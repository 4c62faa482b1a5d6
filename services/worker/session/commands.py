"""What each client command does to a session (called from the runner's mailbox only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.session.engine_session import new_item_id
from shared.contracts import CommittedTurn, DuplexSessionError, ResponseCreateOptions
from shared.protocol.duplex import (
    ACK_ONLY,
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
    DuplexConversationItemTruncated,
    DuplexInputAudioBufferCommitted,
    Heartbeat,
    InputAudioBufferCleared,
    InputAudioTranscriptionCompleted,
    OutputAudioBufferCleared,
    PlaybackAcknowledged,
    ResponseListen,
    SessionHeartbeatAck,
    SessionUpdated,
    SignalTurn,
    TruncateItem,
    TurnEvent,
    UpdateSession,
)

#: Committed turns kept for a later response.create (the latest is answered).
MAX_UNANSWERED_TURNS = 4

if TYPE_CHECKING:
    from services.worker.session.runner import SessionRunner


#: commands that act on the input stream: they wait for the appends and commits sent before them
IN_INPUT_ORDER = (CreateResponse, AppendText, ClearInput)


async def handle(
    runner: SessionRunner, command: DuplexCommand, reserved: int = 0, *, in_order: bool = False
) -> None:
    """Run one command. `reserved` is what the manager reserved for it at dispatch
    (input bytes for an append, a pending turn for a commit)."""
    handler = _HANDLERS.get(type(command))
    if handler is None:
        raise DuplexSessionError("unknown_event", f"{command.wire_type} is not a session command")
    if isinstance(command, IN_INPUT_ORDER) and not in_order:
        runner.schedule_in_order(command)
        return
    if isinstance(command, AppendAudio | Commit):
        await handler(runner, command, reserved)
    else:
        await handler(runner, command)


# ---------------------------------------------------------------- input


async def _append(runner: SessionRunner, command: AppendAudio, reserved: int = 0) -> None:
    session = runner.session
    if not command.audio and not command.video_frames:
        return  # an empty append is a no-op
    if not command.audio and not session.capabilities.allows_video_without_audio:
        raise DuplexSessionError(
            "invalid_video_frames", "this model needs audio with every video frame"
        )
    runner.schedule_append(command, reserved)


async def _append_text(runner: SessionRunner, command: AppendText) -> None:
    if runner.session.model_native:
        raise DuplexSessionError(
            "native_text_append_unsupported", "a model-native session takes audio only"
        )
    runner.session.input.text += command.text


async def _commit(runner: SessionRunner, command: Commit, reserved: int = 0) -> None:
    runner.schedule_commit(command, reserved=bool(reserved))


def commit_turn(
    runner: SessionRunner, command: Commit, transcript: str | None = None
) -> CommittedTurn | None:
    """The commit fan-out: speech_stopped -> item added -> item created -> committed
    -> (transcription) -> item done. Returns the committed turn, or None. `transcript`:
    what the plugin's speech recogniser heard (`DuplexModelPlugin.transcribe`)."""
    session, ledger = runner.session, runner.session.input
    if command.is_speech is False:  # the client declares silence: no turn, no response
        ledger.clear()
        item_id = new_item_id()
        runner.emit(
            DuplexInputAudioBufferCommitted(
                previous_item_id=session.conversation.last_id(),
                item_id=item_id,
                event=_committed_event(session, item_id, empty=True, no_response=True),
            )
        )
        runner.emit(
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
    if not ledger.has_audio and not ledger.text:
        raise DuplexSessionError(
            "input_audio_buffer_empty", "commit without audio", related_event_id=command.event_id
        )
    item_id = ledger.item_id or new_item_id()
    if ledger.speech_started_ms is not None and not ledger.speech_stopped:
        runner.speech_stopped(ledger.stream_ms)
    text = ledger.text
    audio = ledger.take()
    session.turn_id += 1
    session.turn_state = "user_committed"
    content = [{"type": "input_audio", "transcript": None}] if audio.size else []
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
    runner.emit(ConversationItemAdded(previous_item_id=previous, item=item))
    runner.emit(ConversationItemCreated(previous_item_id=previous, item=item))
    runner.emit(
        DuplexInputAudioBufferCommitted(
            previous_item_id=previous,
            item_id=item_id,
            event=_committed_event(session, item_id, empty=False, no_response=False),
        )
    )
    if transcript is not None:
        runner.emit(
            InputAudioTranscriptionCompleted(
                item_id=item_id, content_index=0, transcript=transcript
            )
        )
    runner.emit(ConversationItemDone(previous_item_id=previous, item=item))
    session.pending_turns.append(turn)
    while len(session.pending_turns) > MAX_UNANSWERED_TURNS:
        session.pending_turns.popleft()  # response.create answers the latest turn
    return turn


def _committed_event(session, item_id: str, *, empty: bool, no_response: bool) -> dict:
    return {
        "type": "input.committed",
        "turn_id": session.turn_id,
        "epoch": session.epoch,
        "history_len": len(session.conversation),
        "realtime_item_id": item_id,
        "empty": empty,
        "no_response": no_response,
    }


async def _clear_input(runner: SessionRunner, command: ClearInput) -> None:
    """Runs in input order: what was appended before it is applied, then dropped."""
    _reset_input(runner)
    runner.emit(InputAudioBufferCleared())


async def _cancel_input(runner: SessionRunner, command: CancelInput) -> None:
    """Runs at once: input still in flight is dropped, not waited for."""
    session = runner.session
    session.input_generation += 1  # appends and commits in flight from before are dropped
    session.pending_input_bytes = session.pending_commits = 0  # and their reservations with them
    _reset_input(runner)
    await runner.advance_epoch("input_cancelled")
    runner.emit(InputAudioBufferCleared())


def _reset_input(runner: SessionRunner) -> None:
    runner.session.input.clear()
    runner.pipeline.reset(runner.session.input.stream_ms)


# ---------------------------------------------------------------- responses


async def _create_response(runner: SessionRunner, command: CreateResponse) -> None:
    session = runner.session
    options = ResponseCreateOptions.from_realtime(
        command.options, private_keys=runner.plugin.private_runtime_config_keys
    )
    if session.model_native:
        options.check_native()
    if session.active is not None:
        raise DuplexSessionError(
            "response_already_active", f"response {session.active.response_id} is active"
        )
    if not session.pending_turns:
        if session.unanswered_items:
            session.unanswered_items = 0  # the refusal consumes the items
            raise DuplexSessionError(
                "text_only_turn_unsupported", "this model answers committed audio, not items"
            )
        raise DuplexSessionError(
            "response_create_without_input", "commit audio before response.create"
        )
    await runner.start_response(session.pending_turns[-1], options, command.event_id)


async def _cancel_response(runner: SessionRunner, command: CancelResponse) -> None:
    active = runner.session.active
    if active is None or (
        command.response_id is not None and command.response_id != active.response_id
    ):
        raise DuplexSessionError("response_not_active", "no active response to cancel")
    await runner.advance_epoch("client_cancelled")


async def _clear_output(runner: SessionRunner, command: ClearOutputAudio) -> None:
    session = runner.session
    active, last = session.active, session.last_response
    target = command.response_id
    if target is None and (active or last) is not None:
        target = (active or last).response_id
    if target is None:
        raise DuplexSessionError("response_not_active", "no response to clear")
    if active is not None and active.response_id == target:
        await runner.advance_epoch("client_cancelled")
    elif target not in session.responses:
        raise DuplexSessionError("response_not_active", f"unknown response {target!r}")
    runner.emit(OutputAudioBufferCleared(response_id=target))


async def _barge_in(runner: SessionRunner, command: BargeIn) -> None:
    if not runner.session.capabilities.supports_barge_in:
        raise DuplexSessionError("barge_in_unsupported", "this model does not support barge-in")
    await runner.advance_epoch("barge_in")


# ---------------------------------------------------------------- session, conversation, playback


async def _update(runner: SessionRunner, command: UpdateSession) -> None:
    session = runner.session
    updated = session.config.apply_update(command.patch)
    if updated.voice != session.config.voice and session.audio_started:
        raise DuplexSessionError(
            "voice_update_after_audio_unsupported", "the voice is fixed once audio started"
        )
    runner.plugin.validate_client_extra_body(updated.extra_body)
    session.runtime_config = runner.plugin.runtime_config_for_update(
        session.runtime_config, updated
    )
    runner.pipeline.configure_vad(updated.turn_detection, session.input.stream_ms)
    session.config = updated
    runner.emit(SessionUpdated(session=session.session_object()))


async def _close(runner: SessionRunner, command: CloseSession) -> None:
    """Commands queued before the close have run; the manager closes the session."""
    if runner.on_close is not None:
        runner.on_close(runner.session.session_id, command.reason)


async def _heartbeat(runner: SessionRunner, command: Heartbeat) -> None:
    runner.emit(SessionHeartbeatAck(session_id=runner.session.session_id))


async def _create_item(runner: SessionRunner, command: CreateItem) -> None:
    conversation = runner.session.conversation
    item = dict(command.item)
    item.setdefault("id", new_item_id())
    item.setdefault("status", "completed")
    if any(existing.get("id") == item["id"] for existing in conversation.items):
        raise DuplexSessionError("bad_event", f"item {item['id']!r} already exists")
    previous = conversation.add(item, command.previous_item_id)
    if item.get("role") == "user":
        runner.session.unanswered_items += 1
    for event_type in (ConversationItemAdded, ConversationItemCreated, ConversationItemDone):
        runner.emit(event_type(previous_item_id=previous, item=item))


async def _delete_item(runner: SessionRunner, command: DeleteItem) -> None:
    runner.session.conversation.delete(command.item_id)
    runner.emit(DuplexConversationItemDeleted(item_id=command.item_id, event=command.to_dict()))


async def _truncate_item(runner: SessionRunner, command: TruncateItem) -> None:
    session = runner.session
    if not session.capabilities.supports_audio_truncate:
        raise DuplexSessionError("bad_event", "this model does not support truncation")
    session.conversation.get(command.item_id)  # item_not_found
    response = session.response_by_item(command.item_id)
    if response is None:
        raise DuplexSessionError("bad_event", f"item {command.item_id!r} has no assistant audio")
    if command.audio_end_ms > response.playback.generated_ms + 1e-6:
        raise DuplexSessionError(
            "bad_event", f"audio_end_ms is past the item's {response.playback.generated_ms} ms"
        )
    # the client heard exactly this much: history keeps that prefix
    response.playback.played_ms = response.playback.committed_ms = float(command.audio_end_ms)
    runner.history_item(response, _item_status(response))
    runner.emit(
        DuplexConversationItemTruncated(
            item_id=command.item_id,
            content_index=command.content_index,
            audio_end_ms=int(command.audio_end_ms),
            event=command.to_dict(),
        )
    )


async def _signal(runner: SessionRunner, command: SignalTurn) -> None:
    session = runner.session
    if command.event == "conversation.item.retrieve":
        item_id = command.payload.get("item_id")
        runner.emit(ConversationItemRetrieved(item=session.conversation.get(str(item_id))))
        return
    runner.emit(
        TurnEvent(
            session_id=session.session_id,
            event=command.event,
            turn_state=session.turn_state,
            epoch=session.epoch,
        )
    )


async def _ack_playback(runner: SessionRunner, command: AckPlayback) -> None:
    session = runner.session
    if command.response_id is not None:
        response = session.responses.get(command.response_id)
    else:
        response = session.active or session.last_response
    if response is None:
        raise DuplexSessionError("playback_item_not_found", "no response to acknowledge")
    if command.item_id is not None and command.item_id != response.item_id:
        raise DuplexSessionError(
            "playback_item_mismatch", f"{command.item_id!r} is not {response.response_id}'s item"
        )
    response.playback.acknowledge(command.played_ms, command.committed_ms, command.truncate)
    history = ""
    if response.status != "failed" and (
        command.truncate
        or session.config.playback_commit_policy == ACK_ONLY
        or response.status != "in_progress"
    ):
        history = runner.history_item(response, _item_status(response))["content"][0]["transcript"]
    runner.emit(
        PlaybackAcknowledged(
            event={
                "session_id": session.session_id,
                "epoch": session.epoch,
                "response_id": response.response_id,
                "item_id": response.item_id,
                "played_ms": response.playback.played_ms,
                "committed_ms": response.playback.committed_ms,
                "truncate": command.truncate,
                "playback": response.playback.to_dict(),
                "history_committed": history,
            }
        )
    )


def _item_status(response) -> str:
    return {"completed": "completed", "in_progress": "in_progress"}.get(
        response.status, "incomplete"
    )


_HANDLERS = {
    AppendAudio: _append,
    AppendText: _append_text,
    Commit: _commit,
    ClearInput: _clear_input,
    CancelInput: _cancel_input,
    CreateResponse: _create_response,
    CancelResponse: _cancel_response,
    ClearOutputAudio: _clear_output,
    BargeIn: _barge_in,
    UpdateSession: _update,
    Heartbeat: _heartbeat,
    CloseSession: _close,
    CreateItem: _create_item,
    DeleteItem: _delete_item,
    TruncateItem: _truncate_item,
    SignalTurn: _signal,
    AckPlayback: _ack_playback,
}
