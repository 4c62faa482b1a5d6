"""The response controller: a response's canonical event chain, cancels by epoch with the
playback ledger deciding what history keeps, late outputs dropped, stage failures."""

import pytest

from harness.sessions import types
from shared.contracts import DuplexSessionError
from shared.protocol.duplex import AckPlayback, TruncateItem
from tests.worker.engine.test_echo_turn import RESPONSE_END, RESPONSE_START

AUDIO = ["response.output_audio.delta", "response.output_audio_transcript.delta"]
#: a response cancelled before its first audio closes only what was opened
# a response cancelled before its first output: its audio part (opened with it on the duplex
# surface, as vLLM-Omni 0.30.0 does) closes unused
UNSPOKEN_END = RESPONSE_END[2:]


async def test_a_response_from_start_to_done_in_the_canonical_order(parts):
    response = await parts.start_response()
    plan = parts.port.plans[-1]
    assert (plan.request_id, plan.fence) == (response.request_id, response.fence)
    assert parts.session.turn_state == "assistant_generating"
    await parts.apply(parts.output("audio", 0.1, "echo "))
    assert parts.session.turn_state == "assistant_playing"
    await parts.apply(parts.output("audio", 0.1, "200 ms"))
    await parts.apply(parts.output("done"))
    events = parts.take_events()
    assert types(events) == [*RESPONSE_START, *AUDIO, *AUDIO, *RESPONSE_END]
    assert {e.response_id for e in events if hasattr(e, "response_id")} == {response.response_id}
    deltas = [e for e in events if e.wire_type == "response.output_audio.delta"]
    assert [d.metadata["audio_duration_ms"] for d in deltas] == [100, 200]
    assert [d.metadata["audio_text_marks"] for d in deltas] == [
        [{"text_chars": 5, "audio_end_ms": 100}],
        [{"text_chars": 11, "audio_end_ms": 200}],
    ]
    done = events[-2].response
    assert (done["status"], done["status_details"]) == ("completed", None)
    assert done["metadata"]["committed"] is True
    assert done["metadata"]["playback"] == {
        "generated_ms": 200,
        "sent_ms": 200,
        "played_ms": 0,
        "committed_ms": 200,  # commit_all_on_done: everything generated joins history
    }
    assert done["output"][0]["content"][0]["transcript"] == "echo 200 ms"
    assert parts.session.conversation.get(response.item_id)["status"] == "completed"
    assert parts.session.active is None and parts.session.last_response is response
    assert parts.session.turn_state == "idle" and parts.session.audio_started


async def test_a_client_cancel_keeps_what_was_played_and_drops_late_outputs(parts):
    response = await parts.start_response()
    await parts.apply(parts.output("audio", 0.1, "ab"))
    await parts.apply(parts.output("audio", 0.1, "cd"))
    parts.responses.history.acknowledge_playback(AckPlayback(played_ms=150))
    parts.take_events()
    await parts.responses.advance_epoch("client_cancelled")
    events = parts.take_events()
    assert types(events) == RESPONSE_END
    done = events[-2].response
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert done["metadata"]["playback"]["committed_ms"] == 150
    assert done["output"][0]["content"][0]["transcript"] == "ab"  # the marks up to 150 ms
    assert parts.session.conversation.get(response.item_id)["status"] == "incomplete"
    assert (parts.session.epoch, parts.session.turn_state) == (1, "idle")
    assert parts.port.aborted == [response.request_id]
    for kind in ("audio", "done"):  # the stage had these in flight when the abort came
        await parts.apply(parts.output(kind, fence=response.fence, request_id=response.request_id))
    assert parts.take_events() == [] and parts.responses.dropped_stale_outputs == 2


async def test_a_cancel_before_any_audio_closes_only_what_was_opened(parts):
    await parts.start_response()
    parts.take_events()
    await parts.responses.advance_epoch("barge_in")
    events = parts.take_events()
    assert types(events) == UNSPOKEN_END
    assert events[-2].response["status_details"]["reason"] == "barge_in"
    assert parts.session.turn_state == "barge_in"  # barge-in: the user has the floor


async def test_a_new_response_replaces_the_active_one(parts):
    first = await parts.start_response()
    parts.take_events()
    second = await parts.start_response()
    events = parts.take_events()
    assert types(events) == [*UNSPOKEN_END, *RESPONSE_START[:5]]
    assert events[3].response_id == first.response_id
    assert events[3].response["status_details"]["reason"] == "new_response"
    assert events[5].response_id == second.response_id and parts.session.active is second
    assert parts.session.epoch == 1 and second.fence.epoch == 1


async def test_a_stage_error_fails_the_response_and_leaves_no_history(parts):
    response = await parts.start_response()
    await parts.apply(parts.output("audio", 0.1, "partial"))
    parts.take_events()
    await parts.apply(parts.output("error", error_code="engine_overloaded", message="busy"))
    events = parts.take_events()
    assert types(events) == [*RESPONSE_END, "error"]
    done = events[-3].response
    assert (done["status"], done["metadata"]["committed"]) == ("failed", False)
    assert done["status_details"] == {
        "type": "failed",
        "reason": "engine_overloaded",
        "error": {"type": "invalid_request_error", "code": "engine_overloaded", "retryable": False},
    }
    assert (events[-1].code, events[-1].message) == ("engine_overloaded", "busy")
    assert response.item_id not in [item["id"] for item in parts.session.conversation.items]
    assert parts.session.active is None and parts.session.turn_state == "idle"


async def test_ack_only_history_grows_with_acks_and_truncate_cuts_it(parts):
    await parts.start_response()
    parts.session.config = parts.session.config.apply_update({"playback_commit_policy": "ack_only"})
    response = parts.session.active
    await parts.apply(parts.output("audio", 0.1, "ab"))
    await parts.apply(parts.output("audio", 0.1, "cd"))
    await parts.apply(parts.output("done"))
    parts.take_events()
    assert parts.session.conversation.get(response.item_id)["content"][0]["transcript"] == ""
    parts.responses.history.acknowledge_playback(AckPlayback(played_ms=200))
    ack = parts.take_events()[-1].event
    assert (ack["played_ms"], ack["committed_ms"], ack["history_committed"]) == (200, 200, True)
    assert parts.session.conversation.get(response.item_id)["content"][0]["transcript"] == "abcd"
    parts.responses.history.truncate_item(TruncateItem(item_id=response.item_id, audio_end_ms=100))
    truncated = parts.take_events()[-1]
    assert (truncated.wire_type, truncated.audio_end_ms) == ("conversation.item.truncated", 100)
    assert parts.session.conversation.get(response.item_id)["content"][0]["transcript"] == "ab"
    with pytest.raises(DuplexSessionError) as refused:
        parts.responses.history.truncate_item(
            TruncateItem(item_id=response.item_id, audio_end_ms=300)
        )
    assert refused.value.code == "bad_event"


async def test_close_ends_the_active_response_with_the_cancelled_chain(parts):
    response = await parts.start_response()
    parts.take_events()
    await parts.responses.close("shutdown")
    events = parts.take_events()
    assert types(events) == UNSPOKEN_END
    assert events[-2].response["status_details"] == {"type": "cancelled", "reason": "shutdown"}
    assert parts.port.aborted == [response.request_id]
    await parts.responses.close("shutdown")  # nothing active: nothing more
    assert parts.take_events() == []
