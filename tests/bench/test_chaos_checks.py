"""The chaos checker finds what it is there to find: lost, duplicated and wrong events."""

import base64

import pytest

from bench.chaos import Conversation, RecordingClient, check, expected_echo, turn_audio


@pytest.fixture(autouse=True)
def unparsed_events(monkeypatch):
    """The checker reads raw frames; these synthetic ones carry only the fields it reads."""
    monkeypatch.setattr("shared.client.duplex_client.parse_server_event", lambda data: data)


def session_with_one_answer(
    audio: bytes | None = None, names_ms: int = 200, spoken_ms: int = 200
) -> Conversation:
    client = RecordingClient("ws://unused")
    conversation = Conversation(client, 0)
    pcm = turn_audio(spoken_ms)
    conversation.spoken[spoken_ms] = pcm
    echo = expected_echo(pcm) if audio is None else audio
    frames = [
        {"type": "response.created", "response": {"id": "resp_1"}},
        {
            "type": "response.output_audio.delta",
            "response_id": "resp_1",
            "delta": base64.b64encode(echo).decode(),
        },
        {
            "type": "response.output_audio_transcript.done",
            "response_id": "resp_1",
            "transcript": f"echo {names_ms} ms",
        },
        {"type": "response.done", "response": {"id": "resp_1", "status": "completed"}},
    ]
    for seq, frame in enumerate(frames, start=1):
        client._deliver({**frame, "event_id": f"event_{seq}", "server_event_seq": seq})
    return conversation


def test_a_clean_session_passes():
    conversation = session_with_one_answer()
    assert 200 in conversation.client.answered
    figures = check(conversation)
    assert figures == {
        "lost": 0,
        "missing": [],
        "duplicated": 0,
        "mismatched": 0,
        "partial": 0,
        "events": 4,
    }


def test_a_gap_in_the_seqs_is_a_lost_event():
    conversation = session_with_one_answer()
    conversation.client._deliver({"type": "x", "event_id": "event_9", "server_event_seq": 9})
    assert check(conversation)["lost"] == 4  # 5..8


def test_audio_the_pod_dropped_for_a_cancelled_response_is_not_lost():
    """A barge-in cancels a response: its queued audio deltas are dropped by the API pod
    (by design), and their seqs never reach the client. Any other gap is still lost."""
    client = RecordingClient("ws://unused")
    conversation = Conversation(client, 0)
    frames = [
        (1, {"type": "response.created", "response": {"id": "resp_c"}}),
        (2, {"type": "response.output_audio.delta", "response_id": "resp_c", "delta": ""}),
        (4, {"type": "response.output_audio_transcript.delta", "response_id": "resp_c"}),
        (5, {"type": "response.done", "response": {"id": "resp_c", "status": "cancelled"}}),
        (7, {"type": "input_audio_buffer.speech_stopped"}),
        (8, {"type": "input_audio_buffer.committed"}),
    ]
    for seq, frame in frames:
        client._deliver({**frame, "event_id": f"event_{seq}", "server_event_seq": seq})
    figures = check(conversation)
    assert figures["missing"] == [6] and figures["lost"] == 1  # 3 was the cancelled audio


def test_one_event_under_two_seqs_is_a_duplicate():
    conversation = session_with_one_answer()
    conversation.client._deliver({"type": "x", "event_id": "event_4", "server_event_seq": 5})
    assert check(conversation)["duplicated"] == 1


def test_a_replayed_seq_is_dropped_by_the_client_not_counted():
    conversation = session_with_one_answer()
    conversation.client._deliver({"type": "x", "event_id": "event_3", "server_event_seq": 3})
    assert check(conversation)["duplicated"] == 0
    assert len(conversation.client.frames) == 5 and len(conversation.client.delivered) == 4


def test_audio_that_is_not_the_echo_is_a_mismatch():
    wrong = expected_echo(turn_audio(200))[:-2] + b"\x00\x01"
    assert check(session_with_one_answer(wrong))["mismatched"] == 1


def cut(pcm: bytes, first_chunk: int, chunks: int) -> bytes:
    """The turn less `chunks` 20 ms appends from `first_chunk` on (lost with a pod)."""
    return pcm[: 640 * first_chunk] + pcm[640 * (first_chunk + chunks) :]


def test_the_answer_to_a_turn_a_resume_cut_into_is_partial_not_a_mismatch():
    kept = cut(turn_audio(300), first_chunk=4, chunks=5)  # 200 ms of the 300 arrived
    conversation = session_with_one_answer(expected_echo(kept), names_ms=200, spoken_ms=300)
    conversation.resumed_in.add(300)
    figures = check(conversation)
    assert (figures["mismatched"], figures["partial"]) == (0, 1)


def test_a_cut_answer_without_a_resume_in_its_turn_is_a_mismatch():
    kept = cut(turn_audio(300), first_chunk=4, chunks=5)
    conversation = session_with_one_answer(expected_echo(kept), names_ms=200, spoken_ms=300)
    figures = check(conversation)
    assert (figures["mismatched"], figures["partial"]) == (1, 0)


def test_input_missing_in_two_places_is_a_mismatch_even_after_a_resume():
    twice = cut(cut(turn_audio(300), first_chunk=2, chunks=2), first_chunk=6, chunks=3)
    conversation = session_with_one_answer(expected_echo(twice), names_ms=200, spoken_ms=300)
    conversation.resumed_in.add(300)
    assert check(conversation)["mismatched"] == 1
