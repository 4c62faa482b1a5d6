"""The chaos checker finds what it is there to find: lost, duplicated and wrong events."""

import base64

import pytest

from bench.chaos import Conversation, RecordingClient, check, expected_echo, turn_audio


@pytest.fixture(autouse=True)
def unparsed_events(monkeypatch):
    """The checker reads raw frames; these synthetic ones carry only the fields it reads."""
    monkeypatch.setattr("shared.client.duplex_client.parse_server_event", lambda data: data)


def session_with_one_answer(audio: bytes | None = None) -> Conversation:
    client = RecordingClient("ws://unused")
    conversation = Conversation(client, 0)
    pcm = turn_audio(200)
    conversation.spoken[200] = pcm
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
            "transcript": "echo 200 ms",
        },
        {"type": "response.done", "response": {"id": "resp_1", "status": "completed"}},
    ]
    for seq, frame in enumerate(frames, start=1):
        client._deliver({**frame, "event_id": f"event_{seq}", "server_event_seq": seq})
    return conversation


def test_a_clean_session_passes():
    conversation = session_with_one_answer()
    assert 200 in conversation.client.answered
    assert check(conversation) == {"lost": 0, "duplicated": 0, "mismatched": 0, "events": 4}


def test_a_gap_in_the_seqs_is_a_lost_event():
    conversation = session_with_one_answer()
    conversation.client._deliver({"type": "x", "event_id": "event_9", "server_event_seq": 9})
    assert check(conversation)["lost"] == 4  # 5..8


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
