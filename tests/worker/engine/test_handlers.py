"""The dispatch table: one handler per command class, input-order commands queued behind
the input work before them, and a module that never sees the runner."""

import ast
import dataclasses
from pathlib import Path

import pytest

import services.worker.engine.handlers as handlers_module
from harness.sessions import types
from services.worker.engine.handlers import HANDLERS, IN_INPUT_ORDER, dispatch
from services.worker.engine.input_queue import AppendReady, CommitReady, InOrder
from shared.contracts import DuplexSessionError
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
    CreateItem,
    CreateResponse,
    DeleteItem,
    Heartbeat,
    MuteInput,
    SessionEventAck,
    SignalTurn,
    TruncateItem,
    UpdateSession,
)
from tests.worker.engine.test_echo_turn import COMMIT_FAN_OUT, RESPONSE_END, RESPONSE_START


async def refused(coro) -> str:
    with pytest.raises(DuplexSessionError) as info:
        await coro
    return info.value.code


def test_one_handler_per_session_command():
    assert set(HANDLERS) == {
        AppendAudio,
        AppendText,
        Commit,
        ClearInput,
        CancelInput,
        CreateResponse,
        CancelResponse,
        ClearOutputAudio,
        BargeIn,
        AckPlayback,
        TruncateItem,
        UpdateSession,
        Heartbeat,
        CloseSession,
        CreateItem,
        DeleteItem,
        SignalTurn,
        MuteInput,  # GPT-Live's surface only (SURFACE_COMMANDS)
    }
    assert set(IN_INPUT_ORDER) == {CreateResponse, AppendText, ClearInput, MuteInput}


def test_the_table_never_imports_or_names_the_runner():
    source = Path(handlers_module.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert not any(name.startswith("services.worker.engine.runner") for name in imported)
    assert "SessionRunner" not in source and "runner." not in source


async def test_a_command_of_no_session_is_unknown(parts):
    """The API answers an event ack itself: one reaching a session is a routing bug."""
    assert await refused(dispatch(parts.ctx, SessionEventAck(server_event_seq=1))) == (
        "unknown_event"
    )


async def test_response_create_waits_for_the_commit_before_it(parts):
    parts.speech(0.1)
    parts.commit(create_response=False)
    await dispatch(parts.ctx, CreateResponse(event_id="r1"))
    assert parts.take_events() == [] and parts.session.active is None  # queued, not run
    items = await parts.apply_next(7)
    assert [type(item) for item in items] == [AppendReady] * 5 + [CommitReady, InOrder]
    events = parts.take_events()
    assert types(events) == [
        "input_audio_buffer.speech_started",
        *COMMIT_FAN_OUT,
        *RESPONSE_START[:5],  # the audio part opens with the response (vLLM-Omni 0.30.0)
    ]
    turn_item = events[2].item
    assert events[-2].item["id"] == parts.session.active.item_id
    assert parts.port.plans[-1].payload.transcript == "echo 100 ms"
    assert not parts.session.pending_turns  # answered
    assert parts.session.conversation.items[0]["id"] == turn_item["id"]


async def test_text_appended_after_a_commit_belongs_to_the_next_turn(parts):
    parts.speech(0.04)
    parts.commit(create_response=False)
    await dispatch(parts.ctx, AppendText(text="late"))
    await parts.apply_next(4)
    committed = [e for e in parts.take_events() if e.wire_type == "conversation.item.done"]
    assert committed[0].item["content"] == [{"type": "input_audio", "transcript": None}]
    assert parts.session.input.text == "late"


async def test_input_cancel_during_a_response(parts):
    response = await parts.start_response()
    await parts.apply(parts.output("audio", 0.1, "ab"))
    parts.take_events()
    await dispatch(parts.ctx, CancelInput())
    events = parts.take_events()
    assert types(events) == [*RESPONSE_END, "input_audio_buffer.cleared"]
    assert events[-3].response["status_details"] == {
        "type": "cancelled",
        "reason": "input_cancelled",
    }
    assert (parts.session.epoch, parts.session.input_generation) == (1, 1)
    assert parts.port.aborted == [response.request_id]


async def test_barge_in_and_cancel_commands(parts):
    assert await refused(dispatch(parts.ctx, CancelResponse())) == "response_not_active"
    assert await refused(dispatch(parts.ctx, ClearOutputAudio())) == "response_not_active"
    first = await parts.start_response()
    await dispatch(parts.ctx, BargeIn())
    assert parts.take_events()[-2].response["status_details"]["reason"] == "barge_in"
    assert parts.session.turn_state == "barge_in"
    second = await parts.start_response()
    assert await refused(dispatch(parts.ctx, CancelResponse(response_id=first.response_id))) == (
        "response_not_active"
    )
    parts.take_events()
    await dispatch(parts.ctx, ClearOutputAudio())
    events = parts.take_events()
    # no audio was sent: the part that opened with the response closes, unused
    assert types(events) == [*RESPONSE_END[2:], "output_audio_buffer.cleared"]
    assert events[-1].response_id == second.response_id
    assert events[-3].response["status_details"]["reason"] == "client_cancelled"
    await dispatch(parts.ctx, ClearOutputAudio())  # the last response, once ended: idempotent
    assert types(parts.take_events()) == ["output_audio_buffer.cleared"]
    parts.session.capabilities = dataclasses.replace(
        parts.session.capabilities, supports_barge_in=False
    )
    assert await refused(dispatch(parts.ctx, BargeIn())) == "barge_in_unsupported"


async def test_response_create_refusals(parts):
    assert await refused(dispatch(parts.ctx, CreateResponse(), in_order=True)) == (
        "response_create_without_input"
    )
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    await dispatch(parts.ctx, CreateItem(item=user))
    assert types(parts.take_events()) == [
        "conversation.item.added",
        "conversation.item.created",
        "conversation.item.done",
    ]
    assert await refused(dispatch(parts.ctx, CreateResponse(), in_order=True)) == (
        "text_only_turn_unsupported"
    )
    await parts.start_response()
    assert await refused(dispatch(parts.ctx, CreateResponse(), in_order=True)) == (
        "response_already_active"
    )


async def test_close_asks_the_owner_to_close(parts):
    closes = []
    parts.ctx.on_close = lambda session_id, reason: closes.append((session_id, reason))
    await dispatch(parts.ctx, CloseSession(reason="done"))
    assert closes == [(parts.session.session_id, "done")] and parts.take_events() == []
