"""vLLM-Omni's DuplexClient (the seed's reference client, unchanged) against `duplex serve`, as
its own contract and upstream's harness expect:

- open: session.created, then session.updated;
- a turn on the client's default config (extra_body.auto_response: true): stream_pcm, commit()
  and responses() yields a response that speaks (the client's docstring example);
- explicit turns (auto_response false): commit(create_response=True), and a commit with
  create_response=False answered on response.create;
- per response: response.content_part.added, then response.speak, then the first audio delta;
- cancel_response while the audio streams, and barge-in by speech with server VAD;
- playback.acknowledged: `event.type` and a boolean `event.history_committed`;
- a dropped socket: the client resumes on its own and loses no event (server_event_seq);
- takeover by a second connection (session.replaced), a stale token after it, expiry;
- session.closed with its reason, at the top and in `event`;
- admission: a third session over --max-sessions 2 is refused, and one opened right after a
  client saw session.closed is accepted at once;
- upstream's barge_in_client.py scenario.

See conftest.py for how the client runs.
"""

from __future__ import annotations

#: how far the echo's answer may differ from what it was told (resampling to 24 kHz)
AUDIO_TOLERANCE_MS = 30
BARGE_IN_REASONS = {"turn_detected", "barge_in"}  # upstream's overlap policy says either


def completed(response: dict) -> bool:
    return response["status"] == "completed" and response["audio_ms"] > 0


def test_open_sends_session_created_then_session_updated(run_client):
    run = run_client("open")
    assert run.failed_step is None, run.explain()
    assert run["sent"][0] == "session.update", run.explain()
    assert run["received"][:2] == ["session.created", "session.updated"], run.explain()
    assert run["session_id"] and run["session_id"].startswith("duplex-"), run.explain()
    assert run["resume_token"], run.explain()
    created, updated = run["created"], run["updated"]
    assert "server_event_seq" not in created, run.explain()  # not journaled
    assert isinstance(updated.get("server_event_seq"), int), run.explain()
    assert updated["session"]["model"] == "echo", run.explain()
    assert not run.error_codes(), run.explain()


def test_a_turn_with_auto_response_gets_a_spoken_response(run_client):
    """The client's docstring example: stream_pcm, commit(), responses()."""
    run = run_client("auto_turn")
    assert run["extra_body"] == {"auto_response": True}, run.explain()
    assert run.failed_step is None, run.explain()
    response = run["response"]
    assert response["decision"] == "speak", run.explain()
    assert completed(response), run.explain()
    assert abs(response["audio_ms"] - run["input_ms"]) < AUDIO_TOLERANCE_MS, run.explain()
    assert not run.error_codes(), run.explain()


def test_explicit_turns_on_commit_and_on_response_create(run_client):
    run = run_client("explicit_turns")
    assert run.failed_step is None, run.explain()
    # the client's spelling of the commit's flag
    assert [c.get("response_create") for c in run["commits"]] == [True, False], run.explain()
    first, second = run["responses"]
    assert first["id"] != second["id"], run.explain()
    for response in (first, second):
        assert response["decision"] == "speak", run.explain()
        assert completed(response), run.explain()
        assert abs(response["audio_ms"] - run["input_ms"]) < AUDIO_TOLERANCE_MS, run.explain()
    # the commit with create_response=False made none of its own
    assert run["responses_created"] == 2, run.explain()
    assert not run.error_codes(), run.explain()


def test_response_events_in_upstreams_order(run_client):
    """content_part.added, then response.speak, then the first output_audio.delta."""
    run = run_client("explicit_turns")
    assert run.failed_step is None, run.explain()
    assert len(run["orders"]) == 2, run.explain()
    for order in run["orders"].values():
        assert order == [
            "response.content_part.added",
            "response.speak",
            "response.output_audio.delta",
        ], run.explain()


def test_playback_ack_is_acknowledged_with_history_committed(run_client):
    run = run_client("playback_ack")
    assert run.failed_step is None, run.explain()
    ack = run["ack"]
    assert ack["type"] == "playback.acknowledged", run.explain()
    event = ack.get("event")
    assert isinstance(event, dict), run.explain()
    assert event.get("type") == "playback.acknowledged", run.explain()
    assert event.get("history_committed") is True, run.explain()
    assert not run.error_codes(), run.explain()


def test_cancel_response_during_playback(run_client):
    run = run_client("cancel")
    assert run.failed_step is None, run.explain()
    cancelled = run["cancelled"]
    assert cancelled["status"] == "cancelled", run.explain()
    assert cancelled["reason"] == "client_cancelled", run.explain()
    assert 500 <= cancelled["audio_ms"] < run["input_ms"] - 1000, run.explain()
    assert run["after_done"] == [], f"events of it after its response.done{run.explain()}"
    following = run["following"]
    assert following["id"] != cancelled["id"], run.explain()
    assert completed(following), run.explain()
    assert not run.error_codes(), run.explain()


def test_barge_in_by_speech_during_playback(run_client):
    """Server VAD: speech over the answer cancels it, and the speech is answered."""
    run = run_client("barge_in")
    assert run.failed_step is None, run.explain()
    first, second = run["first"], run["second"]
    assert first["status"] == "cancelled", run.explain()
    assert first["reason"] in BARGE_IN_REASONS, run.explain()
    assert first["audio_ms"] < run["first_input_ms"] - 1000, run.explain()
    assert any(o.get("action") == "barge_in" for o in run["overlap"]), run.explain()
    assert second["id"] != first["id"], run.explain()
    assert completed(second), run.explain()
    assert not run.error_codes(), run.explain()


def test_resume_after_a_dropped_socket_loses_no_event(run_client):
    run = run_client("resume")
    assert run.failed_step is None, run.explain()
    assert run["connections"] == 2, run.explain()
    assert run["resume_sent"][0]["type"] == "session.resume", run.explain()
    assert run["resumed"] is not None, run.explain()
    assert "connection.resumed" in run["delivered"], run.explain()
    # the replay starts where the client left off, and the client drops what it had already
    on_second = run["seqs_on_second"]
    assert on_second and on_second[0] <= run["dropped_after_seq"] + 1, run.explain()
    delivered = run["delivered_seqs"]
    assert delivered == list(range(delivered[0], delivered[0] + len(delivered))), (
        f"server_event_seq not contiguous: {delivered}{run.explain()}"
    )
    assert run["last_seq"] == delivered[-1], run.explain()
    response = run["response"]
    assert completed(response), run.explain()
    assert abs(response["audio_ms"] - run["input_ms"]) < AUDIO_TOLERANCE_MS, run.explain()
    assert not run.error_codes(), run.explain()


def test_takeover_replaces_the_first_connection(run_client):
    run = run_client("takeover")
    assert run.failed_step is None, run.explain()
    resumed, replaced = run["resumed"], run["replaced"]
    assert resumed["type"] == "session.resumed", run.explain()
    assert resumed["session_id"] == run["session_id"], run.explain()
    assert run["token_rotated"], run.explain()
    assert replaced["type"] == "session.replaced", run.explain()
    assert replaced["session_id"] == run["session_id"], run.explain()
    assert isinstance(replaced.get("attachment_generation"), int), run.explain()
    # the second connection has the session: it closes it
    assert run["b_closed"]["type"] == "session.closed", run.explain()


def test_a_stale_token_after_a_takeover_is_refused(run_client):
    """The replaced client resumes with the token it held, which the takeover rotated out:
    `session_resume_conflict` (docs/sessions.md: vLLM-Omni 0.30.0 says
    `invalid_resume_token` there; both are among DuplexClient's fatal resume codes), and it
    gives up at once instead of retrying."""
    run = run_client("takeover")
    assert run.failed_step is None, run.explain()
    assert run["a_resume_sent"][:1] == ["session.resume"], run.explain()
    codes = [reply["code"] for reply in run["a_resume_replies"]]
    assert codes == ["session_resume_conflict"], run.explain()  # one try: no retries
    assert run["a_ended"] is not None, run.explain()
    assert set(run.error_codes()) <= {"session_resume_conflict"}, run.explain()


def test_resume_after_expiry_is_refused(run_client):
    run = run_client("expiry", server="expiry")
    assert run.failed_step is None, run.explain()
    assert run["resume_sent"][:1] == ["session.resume"], run.explain()
    replies = run["resume_replies"]
    assert any(
        r["code"] == "session_resume_expired" or r["type"] == "session.expired" for r in replies
    ), run.explain()
    assert not any(r["type"] == "session.resumed" for r in replies), run.explain()
    assert run["ended"] is not None, run.explain()
    assert set(run.error_codes()) <= {"session_resume_expired"}, run.explain()


def test_close_reports_its_reason_at_the_top_and_in_event(run_client):
    """Upstream's wire: {type, session_id, reason, event: {type, session_id, reason}}."""
    run = run_client("close")
    assert run.failed_step is None, run.explain()
    closed = run["closed"]
    assert closed is not None, run.explain()
    assert closed["session_id"] == run["session_id"], run.explain()
    assert isinstance(closed.get("reason"), str) and closed["reason"], run.explain()
    event = closed.get("event")
    assert isinstance(event, dict), run.explain()
    assert event.get("type") == "session.closed", run.explain()
    assert event.get("reason") == closed["reason"], run.explain()
    assert event.get("session_id", run["session_id"]) == run["session_id"], run.explain()
    assert run["ended"] == "closed", run.explain()  # an expected close, for the client
    assert not run.error_codes(), run.explain()


def test_admission_refuses_a_third_session_and_frees_the_slot_at_session_closed(run_client):
    run = run_client("admission", server="admission")
    assert run.failed_step is None, run.explain()
    third = run["third"]
    assert third.get("code") == "resource_exhausted", run.explain()
    assert run["a_closed"] is not None, run.explain()
    # opened right after the client saw session.closed: no retry, no wait
    assert "opened" in run["replacement"], run.explain()


def test_upstreams_barge_in_client_scenario(run_client):
    """examples/online_serving/barge_in_client.py with DuplexClient: the answer is barged in
    or the remark deferred, and a new response answers the follow-up."""
    run = run_client("barge_in_example")
    assert run.failed_step is None, run.explain()
    responses = run["responses"]
    assert responses, run.explain()
    first = responses[0]
    assert not first["after_follow_up"], run.explain()
    assert not run["first_done_before_follow_up"], f"not talked over{run.explain()}"
    assert first["status"] in ("cancelled", "completed"), run.explain()
    if first["status"] == "cancelled":
        # the example folds any cancel as "cancelled"; a commit over the answer, as here (no
        # VAD), may also end it as a newer turn's (`new_response`)
        assert first["reason"] in {*BARGE_IN_REASONS, "new_response"}, run.explain()
    answers = [r for r in responses if r["after_follow_up"]]
    assert any(completed(r) for r in answers), run.explain()
    assert not run.error_codes(), run.explain()
