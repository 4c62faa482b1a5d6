"""idle_timeout_ms: after the last response has played out, silence for that long commits
the silent buffer (`input_audio_buffer.timeout_triggered`) and creates a response. The
clock is the input audio; a wall-clock check covers a client that stopped streaming."""

import asyncio

import numpy as np

from harness.sessions import FAST, appends, make_harness, send_all, speech_wav, types
from plugins.echo import EchoPlugin
from services.worker.engine.handlers import on_stage_output
from services.worker.engine.idle_timeout import STALL_GRACE_S, IdleDue
from tests.worker.transcribing import feed, loud, of, quiet, settle

TIMEOUT = "input_audio_buffer.timeout_triggered"
IDLE_VAD = {
    "type": "server_vad",
    "prefix_padding_ms": 0,
    "min_speech_duration_ms": 64,
    "silence_duration_ms": 64,
    "idle_timeout_ms": 1000,
}


async def never(delay_s: float) -> None:
    """A wall clock that never wakes: only the audio clock can fire."""
    await asyncio.Event().wait()


async def idle_parts(parts_for, sleep=never, clock=None):
    parts = await parts_for({"turn_detection": IDLE_VAD}, EchoPlugin(), vad=True)
    parts.input.idle.sleep = sleep
    if clock is not None:
        parts.input.idle.clock = clock
    return parts


async def respond(parts, audio_s: float = 0.0) -> None:
    """A response that speaks `audio_s` of audio, unpaced, and completes."""
    await parts.start_response()
    if audio_s:
        await on_stage_output(parts.ctx, parts.output("audio", audio_s))
    await on_stage_output(parts.ctx, parts.output("done"))


async def test_silence_after_the_playback_commits_and_prompts_a_response(parts_for):
    parts = await idle_parts(parts_for)
    await feed(parts, quiet(200))
    await respond(parts, audio_s=0.3)  # its first audio at 200 ms: played out at 500 ms
    assert parts.input.idle.start_ms == 500
    await feed(parts, quiet(1280))  # the stream at 1480 ms: 980 ms after the playback
    assert not of(parts.events, TIMEOUT)
    parts.take_events()
    await feed(parts, quiet(20))  # 1500 ms: idle_timeout_ms of silence
    events = parts.take_events()
    assert types(events) == [
        TIMEOUT,
        "conversation.item.added",
        "conversation.item.created",
        "input_audio_buffer.committed",
        "conversation.item.done",
        "response.created",
        "conversation.item.added",
        "conversation.item.created",
        "response.output_item.added",
        "response.content_part.added",
    ]
    fired = events[0]
    assert (fired.audio_start_ms, fired.audio_end_ms) == (500, 1500)
    item = events[1].item
    assert fired.item_id == item["id"] == events[3].item_id
    assert item["role"] == "user" and item["content"][0]["type"] == "input_audio"
    # the committed turn is the silence after the playback, and the model gets it
    assert parts.port.plans[-1].payload.audio.size == 16000

    # the prompt's own response re-arms the timer when it is done
    await on_stage_output(parts.ctx, parts.output("done"))
    assert parts.input.idle.start_ms == 1500
    await feed(parts, quiet(1000))
    assert [(e.audio_start_ms, e.audio_end_ms) for e in of(parts.events, TIMEOUT)] == [(1500, 2500)]


async def test_speech_disarms_the_timer(parts_for):
    parts = await idle_parts(parts_for)
    await respond(parts)
    assert parts.input.idle.armed
    await feed(parts, loud(100))  # the user speaks before the timeout
    assert not parts.input.idle.armed
    await feed(parts, quiet(200))  # their turn is committed and answered
    await settle(parts)
    assert "response.created" in types(parts.events)
    await feed(parts, quiet(2000))  # no timeout while that response runs
    assert not of(parts.events, TIMEOUT)


async def test_a_client_that_stops_streaming_still_gets_its_timeout(parts_for):
    now = [100.0]
    delays: list[float] = []

    async def wake_at_once(delay_s: float) -> None:
        delays.append(delay_s)

    parts = await idle_parts(parts_for, sleep=wake_at_once, clock=lambda: now[0])
    await feed(parts, quiet(200))  # the last audio, at wall time 100.0
    await respond(parts)  # no audio: played out at once, at 200 ms
    due = await parts.next_ready()
    assert isinstance(due, IdleDue) and delays == [1.0]  # when 1000 ms of audio would be in

    now[0] += STALL_GRACE_S / 2  # audio arrived lately: the audio clock decides
    await parts.apply(due)
    assert not of(parts.events, TIMEOUT)
    again = await parts.next_ready()  # the check, rescheduled
    assert isinstance(again, IdleDue) and delays == [1.0, STALL_GRACE_S]

    now[0] += STALL_GRACE_S  # no audio for longer than the grace: the client stopped
    await parts.apply(again)
    fired = of(parts.events, TIMEOUT)
    assert [(e.audio_start_ms, e.audio_end_ms) for e in fired] == [(200, 200)]
    done = of(parts.events, "conversation.item.done")[-1].item
    assert done["id"] == fired[0].item_id
    assert done["content"] == [{"type": "input_audio", "transcript": None}]  # empty audio
    assert "response.created" in types(parts.events)[types(parts.events).index(TIMEOUT) :]


async def test_a_stale_wall_check_does_nothing(parts_for):
    async def wake_at_once(delay_s: float) -> None:
        pass

    parts = await idle_parts(parts_for, sleep=wake_at_once, clock=lambda: 1e9)
    await respond(parts)
    due = await parts.next_ready()
    await parts.start_response()  # response.created disarms: the check is stale
    await parts.apply(due)
    assert not of(parts.events, TIMEOUT)


async def test_closing_cancels_the_timer(parts_for):
    parts = await idle_parts(parts_for)
    await respond(parts)
    task = parts.input.idle._task
    assert task is not None and not task.done()
    await parts.input.stop()  # what the runner's stop does, at a close or a move
    assert task.cancelled() and not parts.input.idle.armed


async def test_the_cancelled_chain_at_a_close_starts_no_timer(parts_for):
    """The runner stops its input first, then ends the active response (response.done)."""
    parts = await idle_parts(parts_for)
    await parts.start_response()
    await parts.input.stop()
    await parts.responses.close("client_close")
    assert of(parts.events, "response.done")
    assert not parts.input.idle.armed and parts.input.idle._task is None


async def test_without_idle_timeout_ms_nothing_is_armed(parts_for):
    parts = await parts_for(
        {"turn_detection": {**IDLE_VAD, "idle_timeout_ms": None}}, EchoPlugin(), vad=True
    )
    await respond(parts)
    assert not parts.input.idle.armed and parts.input.idle._task is None


async def test_the_idle_prompt_through_the_session_runner():
    """Real Silero VAD and the echo model: the user speaks, the echo answers (unpaced: it
    plays out for its length after response.done), then silence streams in."""
    h = make_harness()
    try:
        session = await h.open(
            {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 1000}, **FAST}
        )
        speech, rate = speech_wav()
        await send_all(session, appends(np.concatenate([speech, quiet(700)]), rate))
        events = await session.until("response.done")
        echo_ms = of(events, "response.output_audio.delta")[-1].metadata["audio_duration_ms"]
        stream_ms = len(speech) * 1000 // rate + 700
        await send_all(session, appends(quiet(int(echo_ms) + 1500), rate))
        events = await session.until(TIMEOUT)
        fired = events[-1]
        assert not of(events[:-1], "input_audio_buffer.speech_started")
        # the silence is counted from the end of the echo's playback
        assert fired.audio_end_ms - fired.audio_start_ms >= 1000
        assert fired.audio_start_ms >= stream_ms - 700
        events = await session.until("response.created")
        committed = of(events, "input_audio_buffer.committed")[0]
        assert committed.item_id == fired.item_id
    finally:
        await h.manager.shutdown()
