"""The openai surface in the worker (services/worker/engine/surface.py): every event a
session opened on plain /v1/realtime emits is OpenAI GA's, checked against the installed
SDK's types (tests/protocol/ga_events.py)."""

import numpy as np
import pytest

from harness.sessions import appends, make_harness, send_all, sine
from services.worker.engine import surface
from services.worker.engine.checkpoint import (
    export_checkpoint,
    read_checkpoint,
    session_from_checkpoint,
)
from services.worker.engine.handlers import dispatch
from services.worker.engine.lease import LeaseState
from shared.contracts import DuplexSessionError
from shared.protocol.duplex import (
    CancelResponse,
    ClearInput,
    Commit,
    CreateResponse,
    Heartbeat,
    RealtimeProtocolError,
    ResponseCreateOptions,
    UpdateSession,
)
from tests.protocol.ga_events import check_ga_event
from tests.worker.session_parts import RecordingPort, close_parts, make_parts
from tests.worker.transcribing import feed, loud, quiet

#: an openai session without turn detection (the client commits), its model unpaced
MANUAL = {"duplex_surface": "openai", "turn_detection": None, "extra_body": {"pace": 0}}


def ga(events) -> list[str]:
    """The events' types, each event checked against GA's types on the way."""
    for event in events:
        check_ga_event(event.to_dict())
    return [event.wire_type for event in events]


async def turn(session, metadata=None) -> None:
    """Half a second of speech at GA's 24 kHz, committed, then response.create."""
    await send_all(session, appends(sine(24000, 0.5), 24000))
    await session.send(Commit())
    options = {} if metadata is None else {"metadata": metadata}
    await session.send(CreateResponse(options=options))


async def test_the_session_object_is_ga_with_ga_defaults(harness):
    session = await harness.client.open({"duplex_surface": "openai"})
    created = session.session  # what session.created carried
    check_ga_event({"type": "session.created", "event_id": "event_1", "session": created})
    assert created["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert created["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert created["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert created["output_modalities"] == ["audio"]
    td = {"type": "semantic_vad", "eagerness": "high", "interrupt_response": False}
    await session.send(UpdateSession(patch={"audio": {"input": {"turn_detection": td}}}))
    updated = await session.recv()
    assert ga([updated]) == ["session.updated"]
    assert updated.session["audio"]["input"]["turn_detection"] == {
        "type": "semantic_vad",
        "eagerness": "high",
        "create_response": True,
        "interrupt_response": False,
    }
    assert "state" not in updated.session and "capabilities" not in updated.session


async def test_a_turn_is_ga_only_and_echoes_the_metadata(harness):
    session = await harness.client.open(MANUAL)
    await turn(session, metadata={"client_event_id": "abc"})
    events = await session.until("rate_limits.updated")
    kinds = ga(events)
    # no speech events without turn detection, no response.speak, no duplex keys (ga())
    assert kinds[:4] == [
        "conversation.item.added",
        "conversation.item.created",
        "input_audio_buffer.committed",
        "conversation.item.done",
    ]
    assert "response.speak" not in kinds and kinds.count("response.output_audio.delta") == 5
    created, done = events[4], events[-2]
    assert created.response["metadata"] == done.response["metadata"] == {"client_event_id": "abc"}
    assert done.response["status"] == "completed" and done.response["usage"]["total_tokens"] == 0


@pytest.mark.parametrize("openai", [True, False])
async def test_a_clients_commit_creates_a_response_only_on_the_duplex_surface(harness, openai):
    opening = {"duplex_surface": "openai"} if openai else {"turn_detection": {}}
    session = await harness.client.open({**opening, "extra_body": {"pace": 0}})
    silence = appends(np.zeros(12000, np.float32), 24000)  # the VAD hears no turn in it
    await send_all(session, silence)
    await session.send(Commit())
    await session.send(ClearInput())  # runs after the commit (and any response it starts)
    kinds = [event.wire_type for event in await session.until("input_audio_buffer.cleared")]
    assert "input_audio_buffer.committed" in kinds
    assert ("response.created" in kinds) is not openai


async def test_a_duplex_session_is_unchanged(harness):
    session = await harness.client.open({"turn_detection": None, "extra_body": {"pace": 0}})
    await turn(session, metadata={"client_event_id": "abc"})
    events = await session.until("rate_limits.updated")
    kinds = [event.wire_type for event in events]
    assert kinds[0] == "input_audio_buffer.speech_started" and "response.speak" in kinds
    assert "duplex_event" in events[-2].response["metadata"]


async def test_tier_3_events_are_not_sent():
    h = make_harness()
    try:
        session = await h.client.open(MANUAL)
        await session.send(Heartbeat())  # the API pod refuses it; the worker drops its ack
        await session.send(ClearInput())
        assert ga([await session.recv()]) == ["input_audio_buffer.cleared"]
    finally:
        await h.manager.shutdown()


@pytest.mark.parametrize("openai", [True, False])
async def test_a_cancelled_response_says_why(openai):
    h = make_harness(port=RecordingPort())  # a stage that never answers: the response stays
    try:
        opening = MANUAL if openai else {"turn_detection": None}
        session = await h.client.open(opening)
        await turn(session)
        await session.until("response.created")  # (the openai surface announces no item yet)
        await session.send(CancelResponse())
        events = await session.until("rate_limits.updated")
        if openai:
            ga(events)
        details = {"type": "cancelled", "reason": "client_cancelled"}  # the same on both
        assert events[-2].response["status_details"] == details
    finally:
        await h.manager.shutdown()


async def test_invalid_metadata_is_refused():
    h = make_harness(port=RecordingPort())
    try:
        session = await h.client.open(MANUAL)
        await turn(session, metadata={"n": 1})
        events = await session.until("error")
        assert (events[-1].code, events[-1].param) == (
            "invalid_session_config",
            "response.metadata",
        )
        assert "response.created" not in [event.wire_type for event in events]
    finally:
        await h.manager.shutdown()


@pytest.mark.parametrize("eagerness", [["high"], {"level": "high"}])
async def test_a_malformed_eagerness_is_refused_at_open_and_in_an_update(eagerness):
    td = {"type": "semantic_vad", "eagerness": eagerness}
    h = make_harness()
    try:
        with pytest.raises(DuplexSessionError) as info:
            await h.client.open({**MANUAL, "turn_detection": td})
        assert (info.value.code, info.value.param) == (
            "unsupported_turn_detection",
            "turn_detection",
        )
        session = await h.client.open(MANUAL)
        await session.send({"type": "session.update", "session": {"turn_detection": td}})
        error = await session.until("error")
        assert (error[-1].code, error[-1].param) == ("unsupported_turn_detection", "turn_detection")
    finally:
        await h.manager.shutdown()


@pytest.mark.parametrize(
    "status, reason, details",
    [
        ("cancelled", "barge_in", {"type": "cancelled", "reason": "turn_detected"}),
        ("cancelled", "new_response", {"type": "cancelled", "reason": "turn_detected"}),
        ("cancelled", "client_cancelled", {"type": "cancelled", "reason": "client_cancelled"}),
        ("cancelled", "input_cancelled", {"type": "cancelled", "reason": "client_cancelled"}),
        ("cancelled", "shutdown", {"type": "cancelled", "reason": None}),
        ("completed", None, None),
        (
            "failed",
            "worker_lost",
            {"type": "failed", "error": {"type": "server_error", "code": "worker_lost"}},
        ),
    ],
)
def test_reasons_map_to_ga(status, reason, details):
    got = surface.status_details(status, reason)
    if got is not None and "error" in got:
        got["error"].pop("message")  # the code's description
    assert got == details
    response = {"status": status, "status_details": surface.status_details(status, reason)}
    check_ga_event({"type": "response.done", "event_id": "event_1", "response": response})


@pytest.mark.parametrize(
    "metadata",
    [{"k": 1}, ["k"], {"k": "v" * 513}, {"k" * 65: "v"}, {str(n): "v" for n in range(17)}],
)
def test_response_metadata_must_be_ga_metadata(metadata):
    options = ResponseCreateOptions.from_realtime({"metadata": metadata})
    with pytest.raises(RealtimeProtocolError) as info:
        surface.response_metadata(options)
    assert (info.value.code, info.value.param) == ("invalid_session_config", "response.metadata")


async def test_interrupt_response_false_lets_the_response_play_on():
    td = {
        "type": "server_vad",
        "interrupt_response": False,
        "prefix_padding_ms": 0,
        "min_speech_duration_ms": 64,
        "silence_duration_ms": 64,
    }
    parts = await make_parts(
        {"duplex_surface": "openai", "turn_detection": td, "extra_body": {"pace": 0}}, vad=True
    )
    try:
        response = await parts.start_response()
        commands = parts.speech(0.2)
        await parts.apply_next(len(commands))
        kinds = [event.wire_type for event in parts.take_events()]
        assert "input_audio_buffer.speech_started" in kinds and "response.done" not in kinds
        assert parts.session.active is response
    finally:
        await close_parts(parts)


async def test_a_turn_ended_under_a_response_that_plays_on_waits_for_response_create():
    """interrupt_response false: the turn is committed, gets no response of its own, and
    stays pending until an input-less response.create answers it (docs/wire-api.md)."""
    td = {"type": "server_vad", "interrupt_response": False, "prefix_padding_ms": 0}
    td |= {"min_speech_duration_ms": 64, "silence_duration_ms": 64}
    parts = await make_parts(
        {"duplex_surface": "openai", "turn_detection": td, "extra_body": {"pace": 0}}, vad=True
    )
    try:
        response = await parts.start_response()
        parts.take_events()
        await feed(parts, np.concatenate([loud(200), quiet(300)]))
        kinds = [event.wire_type for event in parts.take_events()]
        assert "input_audio_buffer.committed" in kinds and "response.created" not in kinds
        (turn,) = parts.session.pending_turns
        await parts.apply(parts.output("done"))
        assert parts.session.active is None and response.reason is None
        await dispatch(parts.ctx, CreateResponse(options={}), in_order=True)
        assert parts.session.active.fence.turn_id == turn.turn_id
        assert list(parts.session.pending_turns) == []
    finally:
        await close_parts(parts)


async def test_the_surface_and_metadata_survive_a_checkpoint():
    h = make_harness(port=RecordingPort())  # the response stays in flight
    try:
        session = await h.client.open(MANUAL)
        await turn(session, metadata={"client_event_id": "abc"})
        await session.until("response.created")
        state = h.manager.table.runner(session.session_id).session
        doc = read_checkpoint(export_checkpoint(state, applied=(0, 0)))
        restored = session_from_checkpoint(
            doc,
            capabilities=state.capabilities,
            lease=LeaseState(None),
            input_rate_hz=16000,
            output_rate_hz=24000,
        )
    finally:
        await h.manager.shutdown()
    assert restored.config == state.config and restored.config.openai_surface
    assert restored.active.metadata == {"client_event_id": "abc"}
