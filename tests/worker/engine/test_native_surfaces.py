"""Moshi's and GPT-Live's surfaces on the worker (native_surfaces.py): a native session opened
with `duplex_surface` "moshi" or "live" through the SessionManager, the echo frame model on a
clock the test moves. What its journal gets: GPT-Live's own events (session.started once the
slot is ready, audio and transcript deltas on the input timeline, the mute acknowledged and
applied in order with the audio, usage, session.closed with reason and usage), or for Moshi
the few events its API pod reads; the surface state in the checkpoint; the surfaces refused
for a model that is not native."""

from __future__ import annotations

import pytest

from harness.frame_models import FRAME_SAMPLES, RATE, tone
from harness.sessions import types
from plugins.echo import EchoPlugin
from services.worker.control.manager import SessionManager
from services.worker.engine.checkpoint import export_checkpoint, read_checkpoint
from services.worker.engine.native_surfaces import TRANSCRIPT_SPAN_MS, USAGE_INTERVAL_MS
from services.worker.engine.surface_state import NativeSurfaceState
from shared.client.inline import InlineDuplexClient, InlineEventRouter
from shared.contracts import DuplexSessionError, SessionRuntimeConfig
from shared.protocol.duplex import MOSHI_AUDIO, MuteInput
from tests.worker.engine.test_native_stream import QUIET, Rig

LIVE = {"duplex_surface": "live"}
MOSHI = {"duplex_surface": "moshi"}


@pytest.fixture
async def rig():
    made = Rig()
    yield made
    await made.manager.shutdown()


async def started(rig, session) -> list:
    """The events up to session.started, which comes with the slot's first step."""
    await rig.tick()
    await rig.settle(session)
    return await session.until("session.started")


def bodies(events, wire_type: str) -> list[dict]:
    return [e.to_dict() for e in events if e.wire_type == wire_type]


async def test_a_live_session_speaks_gpt_lives_events_on_the_input_timeline(rig):
    session = await rig.open(LIVE)
    first = await started(rig, session)
    assert types(first) == ["session.started"]  # session.created: read by the open
    assert first[0].to_dict()["session"] == {"id": session.session_id}
    await rig.say(session, tone(3), QUIET, QUIET, QUIET, QUIET)
    await rig.tick(7)
    await rig.settle(session)
    events = session.pending()
    assert set(types(events)) == {"session.output_audio.delta", "session.output_transcript.delta"}
    audio = bodies(events, "session.output_audio.delta")
    # 3 frames said back, then quiet ones until the model listens again
    assert len(audio) >= 3 and all(set(a) == {"type", "event_id", "delta"} for a in audio)
    words = bodies(events, "session.output_transcript.delta")
    assert [w["delta"] for w in words] == ["."] * 3
    # the timeline is the session's input: 7 frames were said by then (560 ms)
    spoken_ms = 7 * FRAME_SAMPLES * 1000 // RATE
    assert all(w["start_ms"] == spoken_ms for w in words)
    assert all(w["end_ms"] - w["start_ms"] == TRANSCRIPT_SPAN_MS for w in words)


async def test_the_ready_signal_is_sent_once_and_never_on_the_duplex_surface(rig):
    live = await rig.open(LIVE)
    duplex = await rig.open()
    await started(rig, live)
    await rig.tick(3)
    await rig.settle(live)
    await rig.settle(duplex)
    assert "session.started" not in types(live.pending())
    seen = types(duplex.pending())
    assert "session.started" not in seen and not any(t.startswith("duplex.") for t in seen)


async def test_mute_is_acknowledged_and_silences_what_is_said_after_it(rig):
    session = await rig.open(LIVE)
    await started(rig, session)
    await session.send(MuteInput(event_id="m1", muted=True))
    await rig.say(session, tone(3), QUIET, QUIET, QUIET)
    await rig.tick(6)
    await rig.settle(session)
    muted = session.pending()
    assert bodies(muted, "session.input_audio.muted")[0]["client_event_id"] == "m1"
    assert "session.output_audio.delta" not in types(muted)  # the model heard silence
    assert rig.manager.table.runner(session.session_id).session.surface_state.muted
    await session.send(MuteInput(event_id="u1", muted=False))
    await rig.say(session, tone(3), QUIET, QUIET, QUIET)
    await rig.tick(6)
    await rig.settle(session)
    unmuted = session.pending()
    assert bodies(unmuted, "session.input_audio.unmuted")[0]["client_event_id"] == "u1"
    assert types(unmuted).count("session.output_audio.delta") >= 3


async def test_usage_is_reported_as_the_input_grows_and_with_session_closed(rig):
    session = await rig.open(LIVE)
    await started(rig, session)
    frames = USAGE_INTERVAL_MS * RATE // 1000 // FRAME_SAMPLES + 1
    await rig.say(session, *([QUIET] * frames))
    await rig.settle(session)
    (usage,) = bodies(session.pending(), "session.usage.updated")
    said_s = frames * FRAME_SAMPLES / RATE
    assert usage["usage"] == {"seconds": said_s}
    await session.close()
    closed = await session.until("session.closed")
    assert closed[-1].to_dict() | {"event_id": None} == {
        "type": "session.closed",
        "event_id": None,
        "reason": "close_requested",
        "usage": {"seconds": said_s},
    }


async def test_a_moshi_session_journals_only_what_its_pod_reads(rig):
    session = await rig.open(MOSHI)
    first = await started(rig, session)
    assert types(first) == ["session.started"]
    await rig.say(session, tone(3), QUIET, QUIET, QUIET, QUIET, QUIET)
    await rig.tick(9)
    await rig.settle(session)
    events = session.pending()
    assert set(types(events)) == {
        MOSHI_AUDIO,  # the frames' pcm16 as bytes, for the pod's Opus encoder
        "response.output_audio_transcript.delta",
    }
    audio = [e for e in events if e.wire_type == MOSHI_AUDIO]
    # the client's audio is the clock: a frame back for every frame said, the model's
    # quiet ones (before its echo, after it) included
    assert len(audio) == 8
    # what crosses Redis is the frame's samples, not JSON: 80 ms of pcm16 at 24 kHz
    assert all(len(e.payload()) == 2 * FRAME_SAMPLES for e in audio)
    assert not audio[0].payload().startswith(b"{")


async def test_the_surface_state_moves_with_the_checkpoint(rig):
    session = await rig.open(LIVE)
    await started(rig, session)
    await session.send(MuteInput(muted=True))
    await rig.say(session, QUIET)
    engine = rig.manager.table.runner(session.session_id).session
    doc = read_checkpoint(export_checkpoint(engine, applied=(0, 0)))
    assert doc["config"]["duplex_surface"] == "live"
    state = NativeSurfaceState.from_dict(doc["surface_state"])
    assert state == NativeSurfaceState(started=True, muted=True, usage_reported_ms=0)
    assert NativeSurfaceState.from_dict(None) == NativeSurfaceState()  # an older checkpoint


@pytest.mark.parametrize("surface", [LIVE, MOSHI])
async def test_a_model_that_is_not_native_refuses_these_surfaces(surface):
    router = InlineEventRouter()
    manager = SessionManager(EchoPlugin(), SessionRuntimeConfig(max_sessions=2), router)
    try:
        with pytest.raises(DuplexSessionError) as refused:
            await InlineDuplexClient(manager, router).open(surface)
        assert refused.value.code == "invalid_session_config"
        assert "native" in refused.value.message
    finally:
        await manager.shutdown()


async def test_an_expired_live_session_is_closed_once_as_expired(rig):
    """The expiry's own event would be a second `session.closed` to GPT-Live, and the first:
    the publisher would end the session's journal and checkpoint before its close."""
    session = await rig.open(LIVE)
    await started(rig, session)
    await rig.say(session, QUIET, QUIET)
    await rig.manager.expire(session.session_id, "idle_ttl_expired")
    events = await session.until("session.closed")
    assert types(events).count("session.closed") == 1
    assert "session.expired" not in types(events)
    closed = events[-1].to_dict()
    assert closed["reason"] == "expired"
    assert closed["usage"] == {"seconds": 2 * FRAME_SAMPLES / RATE}
