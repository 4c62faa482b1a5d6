"""MAP Realtime V1's surface on the worker (native_surfaces.py): a native session opened with
`duplex_surface` "map" through the SessionManager, the echo frame model on a clock the test
moves. What its journal gets: the model's readiness once (as `session.started {session_id}`,
which the API pod sends as MAP's `session.created`), the model's audio in the session's
output format (float32 at 24 kHz, as the pod opens it) with its words as
`response.output.delta` of kind text, `response.done` with the response's status, a cancel
that says so, errors as `error` only when they end the session (a `warning` otherwise), and
`session.closed` with our reason."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from harness.frame_models import FRAME_SAMPLES, RATE, tone
from harness.sessions import types
from services.worker.engine.native_surfaces import project
from shared.protocol.duplex import (
    BargeIn,
    DuplexErrorEvent,
    map_refusal,
)
from tests.worker.engine.test_native_stream import QUIET, Rig

#: what the API pod opens a map session with (services/api/map_realtime.py)
MAP = {
    "duplex_surface": "map",
    "audio": {
        "input": {"format": {"type": "audio/pcm_f32le", "rate": 16_000}},
        "output": {"format": {"type": "audio/pcm_f32le", "rate": 24_000}},
    },
}


@pytest.fixture
async def rig():
    made = Rig()
    yield made
    await made.manager.shutdown()


async def started(rig, session) -> list:
    await rig.tick()
    await rig.settle(session)
    return await session.until("session.started")


def bodies(events, wire_type: str) -> list[dict]:
    return [e.to_dict() for e in events if e.wire_type == wire_type]


async def test_a_map_session_speaks_maps_events(rig):
    session = await rig.open(MAP)
    first = await started(rig, session)
    assert types(first) == ["session.started"]  # session.created: read by the open
    assert first[0].to_dict()["session_id"] == session.session_id
    await rig.say(session, tone(3), QUIET, QUIET, QUIET, QUIET)
    await rig.tick(8)
    events = await session.until("response.done")
    assert set(types(events)) == {
        "response.output_audio.delta",
        "response.output.delta",
        "response.done",
    }
    audio = bodies(events, "response.output_audio.delta")
    assert all(set(a) == {"type", "event_id", "response_id", "audio"} for a in audio)
    samples = np.frombuffer(b"".join(base64.b64decode(a["audio"]) for a in audio), "<f4")
    # float32 at 24 kHz, the model's rate: whole frames, the echo's tone loud in them
    assert samples.size % FRAME_SAMPLES == 0 and samples.size >= 3 * FRAME_SAMPLES
    assert float(np.abs(samples).max()) > 0.1
    words = bodies(events, "response.output.delta")
    assert [(w["kind"], w["text"]) for w in words] == [("text", ".")] * 3
    (done,) = bodies(events, "response.done")
    assert done["response"]["status"] == "completed"
    assert {a["response_id"] for a in audio} == {done["response"]["id"]}
    assert RATE == 24_000  # the test model's rate is MAP's output rate: nothing resampled


async def test_a_barge_in_ends_the_response_cancelled_and_the_ready_is_said_once(rig):
    session = await rig.open(MAP)
    await started(rig, session)
    await rig.say(session, tone(6))
    await rig.tick(4)
    await session.until("response.output_audio.delta")
    await session.send(BargeIn())
    (done,) = bodies(await session.until("response.done"), "response.done")
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "barge_in"
    await rig.tick(3)
    await rig.settle(session)
    assert "session.started" not in types(session.pending())


async def test_a_map_session_closes_with_our_reason_once(rig):
    session = await rig.open(MAP)
    await started(rig, session)
    await rig.manager.expire(session.session_id, "idle_ttl_expired")
    events = await session.until("session.closed")
    assert types(events).count("session.closed") == 1
    assert "session.expired" not in types(events)
    closed = events[-1].to_dict()
    assert {k: v for k, v in closed.items() if k != "event_id"} == {
        "type": "session.closed",
        "reason": "timeout",  # an expiry's close, as on every surface
    }


async def test_an_error_is_an_error_only_when_the_session_ends_on_it(rig):
    session = await rig.open(MAP)
    engine = rig.manager.table.runner(session.session_id).session
    outlived = DuplexErrorEvent.for_code("input_backpressure", "slow down", related_event_id="a")
    ending = DuplexErrorEvent.for_code("worker_lost", "no worker could take it")
    warning, error = project(outlived, engine), project(ending, engine)
    assert warning is not None and error is not None
    assert warning.to_dict() | {"event_id": None} == {
        "type": "warning",
        "event_id": None,
        "warning": {
            "type": "rate_limit_error",
            "code": "input_backpressure",
            "message": "slow down",
        },
    }
    assert error.to_dict()["error"]["code"] == "worker_lost"
    assert error.wire_type == "error"
    # the pod's own refusals take the same shape (shared/protocol/duplex/map_realtime.py)
    assert map_refusal(outlived.error_body())["type"] == "warning"
    assert map_refusal(outlived.error_body(), ends=True)["type"] == "error"
