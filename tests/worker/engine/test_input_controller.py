"""The input controller: one input task, results applied in queue order, stale work dropped,
every reservation given back once, and server VAD's speech, barge-in and turn commit."""

import asyncio
import threading

import numpy as np

from harness.sessions import sine, types
from services.worker.engine.handlers import dispatch
from services.worker.engine.input_queue import AppendReady, CommitReady, InOrder
from shared.protocol.duplex import AckPlayback, CancelInput, ClearInput
from tests.worker.engine.test_echo_turn import COMMIT_FAN_OUT, RESPONSE_END, RESPONSE_START
from tests.worker.session_parts import RATE, SESSION_ID

INPUT_TASK = f"session-input:{SESSION_ID}"


def loud(ms: int) -> np.ndarray:
    return np.full(RATE * ms // 1000, 0.3, np.float32)


def quiet(ms: int) -> np.ndarray:
    return np.zeros(RATE * ms // 1000, np.float32)


async def test_appends_then_commit_give_exactly_the_committed_turn_events(parts):
    commands = parts.speech(0.1)  # five 20 ms appends
    parts.commit(event_id="c1", create_response=False)
    items = await parts.apply_next(6)
    assert [type(item) for item in items] == [AppendReady] * 5 + [CommitReady]
    assert [item.command for item in items[:5]] == commands  # converted in order
    events = parts.take_events()
    assert types(events) == ["input_audio_buffer.speech_started", *COMMIT_FAN_OUT]
    started, stopped, added, created, committed, done = events
    item_id = added.item["id"]
    assert (started.audio_start_ms, started.item_id) == (0, item_id)
    assert (stopped.audio_end_ms, stopped.item_id) == (100, item_id)
    assert added.item == created.item == done.item
    assert added.item["content"] == [{"type": "input_audio", "transcript": None}]
    assert added.previous_item_id is None and committed.item_id == item_id
    assert committed.event == {
        "type": "input.committed",
        "turn_id": 1,
        "epoch": 0,
        "history_len": 1,
        "realtime_item_id": item_id,
        "empty": False,
        "no_response": False,
    }
    turn = parts.session.pending_turns[-1]
    assert (turn.turn_id, turn.item_id, len(turn.audio)) == (1, item_id, 1600)
    np.testing.assert_allclose(turn.audio, sine(RATE, 0.1), atol=1e-4)  # the audio, in order
    assert (parts.session.pending_input_bytes, parts.session.pending_commits) == (0, 0)
    assert parts.session.turn_state == "user_committed" and parts.port.plans == []


async def test_a_clear_between_appends_drops_the_appends_before_it(parts):
    parts.append(loud(20))
    parts.append(loud(20))
    await dispatch(parts.ctx, ClearInput())  # input order: behind the two appends
    kept = parts.append(loud(60))
    parts.commit(create_response=False)
    items = await parts.apply_next(5)
    assert [type(item) for item in items] == [
        AppendReady,
        AppendReady,
        InOrder,
        AppendReady,
        CommitReady,
    ]
    assert items[3].command is kept
    events = parts.take_events()
    assert types(events) == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.cleared",
        "input_audio_buffer.speech_started",
        *COMMIT_FAN_OUT,
    ]
    assert (events[0].audio_start_ms, events[2].audio_start_ms) == (0, 40)
    assert events[3].audio_end_ms == 100
    assert len(parts.session.pending_turns[-1].audio) == RATE * 60 // 1000  # only the kept append
    assert (parts.session.pending_input_bytes, parts.session.pending_commits) == (0, 0)


async def test_input_cancel_drops_work_in_flight_before_it_is_converted(parts):
    converted = []
    convert = parts.pipeline.convert

    def spy(command, silence_rms):
        converted.append(command)
        return convert(command, silence_rms)

    parts.pipeline.convert = spy
    parts.speech(0.04)
    parts.commit()
    await dispatch(parts.ctx, CancelInput())  # runs at once, before the input task took any
    assert (parts.session.input_generation, parts.session.pending_input_bytes) == (1, 0)
    assert parts.session.pending_commits == 0
    assert types(parts.take_events()) == ["input_audio_buffer.cleared"]  # no response to cancel
    kept = parts.append(loud(20))
    parts.commit(create_response=False)
    items = await parts.apply_next(2)
    assert [type(item) for item in items] == [AppendReady, CommitReady]
    assert items[0].command is kept and items[0].generation == items[1].generation == 1
    assert converted == [kept]  # the stale appends never reached the resampler or VAD
    events = parts.take_events()
    assert types(events) == ["input_audio_buffer.speech_started", *COMMIT_FAN_OUT]
    assert (events[0].audio_start_ms, events[1].audio_end_ms) == (0, 20)
    assert (parts.session.pending_input_bytes, parts.session.pending_commits) == (0, 0)


async def test_a_stale_result_in_the_mailbox_is_dropped_and_released_once(parts):
    parts.append(loud(20), reserved=640)
    stale = await parts.next_ready()  # converted under generation 0, not applied yet
    await dispatch(parts.ctx, CancelInput())  # zeroes generation 0's reservations
    await parts.apply(stale)
    assert parts.session.pending_input_bytes == 0  # not -640: given back by the cancel only
    assert parts.session.input.samples == 0
    assert types(parts.take_events()) == ["input_audio_buffer.cleared"]


async def test_one_input_task_however_many_appends(parts):
    before = asyncio.all_tasks()
    commands = parts.speech(1.0)
    assert len(commands) == 50
    for _ in commands:
        await parts.apply(await parts.next_ready())
        assert asyncio.all_tasks() - before == set()  # no task per append
    named = [t.get_name() for t in asyncio.all_tasks() if SESSION_ID in t.get_name()]
    assert named == [INPUT_TASK]


async def test_stop_gives_back_what_unfinished_work_reserved(parts):
    entered, gate = threading.Event(), threading.Event()
    convert = parts.pipeline.convert

    def held(command, silence_rms):
        entered.set()
        gate.wait(10)
        return convert(command, silence_rms)

    parts.pipeline.convert = held
    parts.append(loud(500), reserved=32_000)  # 8000 samples: converted on the executor
    parts.speech(0.04)
    parts.commit()
    assert (parts.session.pending_input_bytes, parts.session.pending_commits) == (32_200, 1)
    await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
    task = next(t for t in asyncio.all_tasks() if t.get_name() == INPUT_TASK)
    await parts.input.stop()  # one append in flight, two appends and a commit queued
    gate.set()
    assert task.cancelled()
    assert (parts.session.pending_input_bytes, parts.session.pending_commits) == (0, 0)
    assert parts.mailbox.empty()


async def test_vad_barge_in_cancels_the_response_and_the_speech_is_the_next_turn(vad_parts):
    parts = vad_parts
    response = await parts.start_response()
    await parts.apply(parts.output("audio", 0.1, "ab"))
    await parts.apply(parts.output("audio", 0.1, "cd"))
    parts.responses.history.acknowledge_playback(AckPlayback(played_ms=100))
    parts.take_events()

    parts.append(loud(64))  # two loud frames: speech starts at 0 (no prefix padding)
    await parts.apply_next(1)
    events = parts.take_events()
    assert types(events) == ["input_audio_buffer.speech_started", "overlap.decision", *RESPONSE_END]
    assert events[0].audio_start_ms == 0
    overlap = events[1]
    assert (overlap.action, overlap.reason, overlap.epoch) == (
        "barge_in",
        "server_vad_utterance_active",
        0,
    )
    assert overlap.metadata == {"overlap_ms": 200}
    done = events[-2].response
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "barge_in"}
    assert done["metadata"]["playback"] == {
        "generated_ms": 200,
        "sent_ms": 200,
        "played_ms": 100,
        "committed_ms": 100,
    }
    assert done["output"][0]["status"] == "incomplete"
    assert done["output"][0]["content"][0]["transcript"] == "ab"  # what was played
    assert (parts.session.epoch, parts.session.turn_state) == (1, "barge_in")
    assert parts.port.aborted == [response.request_id]

    await parts.apply(parts.output("audio", fence=response.fence, request_id=response.request_id))
    assert parts.take_events() == [] and parts.responses.dropped_stale_outputs == 1

    parts.append(quiet(64))  # two quiet frames: speech stops; server VAD commits the turn
    items = await parts.apply_next(2)
    assert [type(item) for item in items] == [AppendReady, CommitReady]
    events = parts.take_events()
    assert types(events) == [*COMMIT_FAN_OUT, *RESPONSE_START[:5]]
    assert events[0].audio_end_ms == 64
    assert events[3].event["turn_id"] == 1 and events[3].event["epoch"] == 1
    assert parts.port.plans[-1].payload.transcript == "echo 128 ms"  # barge-in speech kept
    assert (parts.session.pending_input_bytes, parts.session.pending_commits) == (0, 0)
    assert parts.session.turn_state == "assistant_generating"
