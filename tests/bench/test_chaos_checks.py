"""The chaos checker finds what it is there to find: lost, duplicated and wrong events, and
native sessions' model histories with a gap, a repeat, a rewrite or a move that lost frames."""

import base64

import numpy as np
import pytest

from bench.chaos_native import Restore, Snapshot, check_history, parse_restores
from harness.recording_client import Conversation, RecordingClient, check, expected_echo, turn_audio


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


# ---------------------------------------------------------------- native histories


def steps(first: int, last: int) -> bytes:
    """An echo frame model's history: the step numbers first..last, uint32 each."""
    return np.arange(first, last + 1, dtype="<u4").tobytes()


def snap(at: float, generation: int, history: bytes) -> Snapshot:
    return Snapshot(at, generation, f"w-{generation}", history)


def moved(generation: int, frames: int | None, seconds: float = 0.08) -> Restore:
    return Restore("w-b", "s", "drain", generation, frames, None if frames is None else seconds)


def test_a_history_counted_on_from_its_restore_passes_and_the_move_is_exact():
    snapshots = [
        snap(1.0, 1, steps(1, 20)),
        snap(2.0, 1, steps(1, 30)),
        snap(2.1, 2, steps(1, 30)),  # owned anew, the new owner has not appended yet
        snap(3.0, 2, steps(1, 45)),
    ]
    figures = check_history("echo", 4, snapshots, [moved(2, 30)], opened_at=-1.0)
    assert figures.problems == [] and (figures.exact, figures.bounded) == (1, 0)
    assert figures.frames == 45


def test_a_move_the_sampler_saw_only_after_the_new_owners_append_is_bounded():
    snapshots = [snap(1.0, 1, steps(1, 30)), snap(3.0, 2, steps(1, 45))]
    figures = check_history("echo", 4, snapshots, [moved(2, 30)], opened_at=-1.0)
    assert figures.problems == [] and (figures.exact, figures.bounded) == (0, 1)


@pytest.mark.parametrize(
    ("history", "kind"),
    [
        (steps(1, 10) + steps(12, 20), "a gap at frame 11"),
        (steps(1, 10) + steps(10, 20), "a repeat at frame 11"),
        (steps(1, 10) + b"\x01", "not whole"),
    ],
)
def test_a_gap_a_repeat_or_a_torn_record_in_the_history_is_found(history, kind):
    figures = check_history("echo", 4, [snap(5.0, 1, history)], [], opened_at=0.0)
    assert any(kind in problem for problem in figures.problems), figures.problems


def test_a_restore_that_read_less_than_its_old_owner_wrote_is_found():
    """The old owner was seen with 30 frames; the new one restored 25 and wrote on from
    there (over the old frames 26..30): the echo model's numbers still count 1..N, but the
    move lost what the old owner had written."""
    snapshots = [snap(1.0, 1, steps(1, 30)), snap(3.0, 2, steps(1, 40))]
    figures = check_history("echo", 4, snapshots, [moved(2, 25)], opened_at=0.0)
    assert any("read 25 frames" in problem for problem in figures.problems), figures.problems


def test_a_record_rewritten_with_other_bytes_is_found():
    """Moshi's records are tokens: a new owner writing over the old owner's frames changes
    bytes an earlier snapshot held."""
    old = bytes(range(10)) * 3
    new = bytes(range(10)) * 2 + bytes(range(10, 20)) * 2
    snapshots = [snap(1.0, 1, old), snap(3.0, 2, new)]
    figures = check_history("moshi", 10, snapshots, [moved(2, 3)], opened_at=0.0)
    assert any("not a prefix" in problem for problem in figures.problems), figures.problems


def test_a_move_no_worker_logged_and_a_last_owner_that_never_replayed_are_found():
    snapshots = [snap(1.0, 1, steps(1, 30)), snap(3.0, 3, steps(1, 40))]
    figures = check_history("echo", 4, snapshots, [moved(3, None)], opened_at=0.0)
    assert any("generations [2]" in p for p in figures.problems), figures.problems
    assert any("never replayed" in p for p in figures.problems), figures.problems


def test_more_frames_than_the_clock_gave_ticks_is_found():
    figures = check_history("echo", 4, [snap(1.0, 1, steps(1, 100))], [], opened_at=0.0)
    assert any("more than the clock" in p for p in figures.problems), figures.problems


def test_restores_are_read_from_the_workers_log_with_their_replay():
    log = "\n".join(
        [
            "2026-12-07 INFO services.worker.control.moves: session sess_a restored "
            "(drain, owner generation 3, applied 12-0)",
            "2026-12-07 INFO services.worker.control.moves: session sess_b restored "
            "(worker_lost, owner generation 2, applied 7-0)",
            "2026-12-07 INFO services.worker.stages.tick_batched: frame_echo: session sess_a "
            "restored (120 frames replayed in 0.081 s, 118.5x real time, 1 tick)",
        ]
    )
    found = parse_restores(log, "worker-1")
    assert [(r.session, r.reason, r.generation, r.frames, r.seconds) for r in found] == [
        ("sess_a", "drain", 3, 120, 0.081),
        ("sess_b", "worker_lost", 2, None, None),  # its replay never finished here
    ]
    assert found[0].pace == pytest.approx(120 * 0.08 / 0.081)
