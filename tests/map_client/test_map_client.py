"""OpenBMB's realtime SDK (`openbmb-realtime` 0.1.6, unchanged) against `duplex serve`, as its
own code expects the server to behave (openbmb_realtime/session.py, protocol.py):

- connect: the server's `session.queue_done` makes the SDK send `session.init` (built from
  `connect()`'s arguments), and `connect()` returns on `session.created` with the session's
  id; the subprotocol is `map.realtime`;
- audio: float32 16 kHz sent with `send_audio`, the model's float32 24 kHz back as
  `AudioDelta`s, its words as `TextDelta`s, the turn's end as `TurnCompleted`; `close()`
  ends with `SessionClosed` and the state `closed`;
- `interrupt()`: the next append carries `force_listen`, the model's response ends cancelled,
  and the model is heard again after it;
- a video session: `send_audio_video` carries one JPEG with each chunk, and the model says it
  got that JPEG, byte for byte; `send_video_frame` alone is the SDK's own refusal;
- input the server refuses (bad base64, not whole float32 samples, a frame that is not JSON,
  an unknown type) comes back as warnings, which the SDK ignores: no `ErrorEvent`, the
  session is not failed and goes on;
- an open the server refuses makes `connect()` raise `RealtimeError` with our code;
- both slots held: a third client is queued (`SessionQueued`), and gets the slot a closing
  session frees (`WorkerAssigned`, `SessionReady`).

The SDK has no resume (its session is its socket): nothing to test there. See conftest.py for
how the client runs.
"""

from __future__ import annotations

import hashlib

from tests.e2e.map_models import seen


def test_connect_init_created_audio_both_ways_and_close(run_client):
    run = run_client("audio")
    assert run.failed_step is None, run.explain()
    assert run["sdk_version"] == "0.1.6"
    assert run["subprotocol"] == "map.realtime", run.explain()
    assert run["init"] == {"type": "session.init", "payload": {"system_prompt": "Be brief."}}
    assert run["session_id"].startswith("duplex-"), run.explain()
    assert run["state_after_connect"] == "ready"
    # queue_done before the SDK's init, then created; no queue (a slot was free)
    assert run["received"][:2] == ["session.queue_done", "session.created"], run.explain()
    assert run["sent"][0] == "session.init", run.explain()
    events = run["events"]
    assert events[:2] == ["WorkerAssigned", "SessionReady"], run.explain()
    assert "ErrorEvent" not in events and events[-1] == "SessionClosed", run.explain()
    heard = run["heard"]
    # float32 at 24 kHz: the echo's 80 ms frames, 1920 samples each; the tone said back
    assert heard["bytes_per_delta"] == [1920 * 4], run.explain()
    assert heard["peak"] > 0.1, run.explain()
    assert set(run["texts"]) == {"."}, run.explain()
    assert run["closed_reason"] == "client_close"
    assert run["state_after_close"] == "closed"
    assert run["sent"][-1] == "session.close" and run["received"][-1] == "session.closed"


def test_interrupt_forces_listen_and_cuts_the_models_speech(run_client):
    run = run_client("interrupt")
    assert run.failed_step is None, run.explain()
    assert run["interrupted"] and run["force_listen_appends"] == 1, run.explain()
    assert "cancelled" in run["statuses"], run.explain()
    assert run["errors"] == [] and run["state"] != "failed", run.explain()


def test_a_video_session_carries_its_jpeg_to_the_model(run_client, frame):
    run = run_client("video")
    assert run.failed_step is None, run.explain()
    assert run["frame_alone"] == "video_audio_required"  # the SDK's rule, before the wire
    assert run["frames_per_append"] == [1] and run["same_frame"], run.explain()
    marker = seen(frame)
    assert marker == f"<jpeg {len(frame)} sha256:{hashlib.sha256(frame).hexdigest()[:8]}>"
    assert any(marker in text for text in run["texts"]), run.explain()
    assert all(text.replace(marker, "") in ("", ".") for text in run["texts"]), run.explain()
    assert run["errors"] == [] and run["warnings"] == [], run.explain()


def test_refused_input_is_warned_and_the_session_goes_on(run_client):
    run = run_client("bad_input")
    assert run.failed_step is None, run.explain()
    assert [tuple(w) for w in run["warnings"]] == [
        ("bad_audio", "input.audio"),
        ("bad_audio", "input.audio"),
        ("invalid_json", None),
        ("unknown_event", "type"),
    ], run.explain()
    assert run["errors"] == [] and run["state"] != "failed", run.explain()
    assert run["heard"]["peak"] > 0.1, run.explain()


def test_a_refused_open_raises_with_our_code(run_client):
    run = run_client("refused")
    assert run.failed_step is None, run.explain()
    outcomes = run["outcomes"]
    assert outcomes["temperature"]["code"] == "invalid_session_config", run.explain()
    assert outcomes["temperature"]["phase"] == "connecting"
    assert "temperature" in outcomes["temperature"]["message"]
    assert outcomes["model"]["code"] == "invalid_session_config", run.explain()
    assert "nobody" in outcomes["model"]["message"]
    # a wrong key is HTTP 401 before the upgrade: the SDK says it could not connect
    assert outcomes["key"]["code"] == "socket_create_failed", run.explain()


def test_a_client_waits_in_the_queue_for_a_freed_slot(run_client):
    run = run_client("queue")
    assert run.failed_step is None, run.explain()
    assert run["init_before_queue_done"] is False, run.explain()
    assert run["received"][0] == "session.queued", run.explain()
    events = run["events"]
    assert events[0] == "SessionQueued", run.explain()
    assert events.index("WorkerAssigned") < events.index("SessionReady"), run.explain()
    # we keep no queue of positions across API pods: the SDK's fields are left empty
    assert run["queued"][0] == [None, None, None], run.explain()
    assert run["session_id"].startswith("duplex-")
