"""A full echo turn: exact event order, and the audio that comes back is the input."""

import base64

import numpy as np
import pytest

from harness.sessions import appends, send_all, sine, types
from plugins.echo.stage import resample_whole
from shared.protocol.duplex import (
    AudioFormat,
    Commit,
    DuplexInputConverter,
    float_to_pcm16,
    pcm16_to_float,
    ulaw_to_int16,
)

RESPONSE_START = [
    "response.created",
    "conversation.item.added",
    "conversation.item.created",
    "response.output_item.added",
    "response.content_part.added",
    "response.speak",
]
RESPONSE_END = [
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
    "rate_limits.updated",
]
COMMIT_FAN_OUT = [
    "input_audio_buffer.speech_stopped",
    "conversation.item.added",
    "conversation.item.created",
    "input_audio_buffer.committed",
    "conversation.item.done",
]


async def test_full_turn_event_order_and_audio(harness):
    session = await harness.open()
    signal = sine(24000, 1.0)
    await send_all(session, appends(signal, 24000))
    await session.send({"type": "input.commit", "event_id": "c1"})
    events = await session.until("rate_limits.updated")
    deltas = [e for e in events if e.wire_type == "response.output_audio.delta"]
    assert len(deltas) == 10  # 1 s in 100 ms chunks
    expected = (
        ["input_audio_buffer.speech_started", *COMMIT_FAN_OUT, *RESPONSE_START]
        + ["response.output_audio.delta", "response.output_audio_transcript.delta"] * 10
        + RESPONSE_END
    )
    assert types(events) == expected

    # the echo is the committed audio: input converted to 16 kHz, then to the 24 kHz output
    converter = DuplexInputConverter()
    chunks = [
        converter.convert(a.audio, AudioFormat("pcm16", 24000)) for a in appends(signal, 24000)
    ]
    model_input = np.concatenate([*chunks, converter.flush()])
    expected_pcm = float_to_pcm16(resample_whole(model_input, 16000, 24000))
    returned = b"".join(base64.b64decode(d.delta) for d in deltas)
    assert returned == expected_pcm
    heard = pcm16_to_float(returned)
    assert len(heard) == 24000
    np.testing.assert_allclose(
        heard[2400:-2400], signal[2400:-2400], atol=0.01
    )  # and it sounds like the input

    transcript_deltas = [
        e.delta for e in events if e.wire_type == "response.output_audio_transcript.delta"
    ]
    done = next(e for e in events if e.wire_type == "response.output_audio_transcript.done")
    assert "".join(transcript_deltas) == done.transcript == "echo 1000 ms"
    response_done = events[-2]
    assert response_done.response["status"] == "completed"
    assert response_done.response_id == events[len(COMMIT_FAN_OUT) + 1].response_id
    assert deltas[0].format == "pcm16" and deltas[0].sample_rate_hz == 24000
    assert deltas[-1].metadata["audio_duration_ms"] == pytest.approx(1000)
    committed = events[4]
    assert committed.wire_type == "input_audio_buffer.committed" and committed.event["turn_id"] == 1


async def test_commit_fan_out_and_history(harness):
    session = await harness.open()
    await send_all(session, appends(sine(16000, 0.2), 16000))
    await session.send(Commit(event_id="plain"))  # OpenAI's commit: no response by default
    events = await session.until("conversation.item.done")
    assert types(events) == ["input_audio_buffer.speech_started", *COMMIT_FAN_OUT]
    added, created, committed, done = events[2], events[3], events[4], events[5]
    assert added.item == created.item == done.item
    assert added.item["role"] == "user" and committed.item_id == added.item["id"]
    assert added.previous_item_id is None
    assert session.pending() == []  # no response without create_response


async def test_response_create_answers_the_committed_turn(harness):
    session = await harness.open()
    await session.send({"type": "response.create", "event_id": "r0"})
    error = await session.recv()
    assert (error.code, error.related_event_id) == ("response_create_without_input", "r0")
    await send_all(session, appends(sine(16000, 0.3), 16000))
    await session.send(Commit(create_response=False))
    await session.until("conversation.item.done")
    await session.send({"type": "response.create"})
    events = await session.until("rate_limits.updated")
    assert events[0].wire_type == "response.created"
    assert next(
        e for e in events if e.wire_type == "response.output_audio_transcript.done"
    ).transcript == ("echo 300 ms")
    await session.send({"type": "response.create", "event_id": "again"})
    assert (await session.recv()).code == "response_create_without_input"


async def test_empty_commit_is_refused(harness):
    session = await harness.open()
    await session.send({"type": "input_audio_buffer.commit", "event_id": "e1"})
    error = await session.recv()
    assert (error.code, error.related_event_id, error.error_type) == (
        "input_audio_buffer_empty",
        "e1",
        "invalid_request_error",
    )


async def test_declared_silence_commit_listens(harness):
    session = await harness.open()
    await send_all(session, appends(sine(16000, 0.1), 16000))
    await session.send(Commit(is_speech=False, create_response=True))
    events = await session.until("response.listen")
    assert types(events)[-2:] == ["input_audio_buffer.committed", "response.listen"]
    assert events[-2].event["empty"] is True and events[-2].event["no_response"] is True
    assert events[-1].response["metadata"]["reason"] == "silence_or_noise"


async def test_output_format_g711_at_8k(harness):
    session = await harness.open({"output_audio_format": "g711_ulaw", "extra_body": {"pace": 0}})
    signal = sine(16000, 0.5)
    await send_all(session, appends(signal, 16000))
    await session.send({"type": "input.commit"})
    events = await session.until("rate_limits.updated")
    deltas = [e for e in events if e.wire_type == "response.output_audio.delta"]
    body = b"".join(base64.b64decode(d.delta) for d in deltas)
    assert deltas[0].format == "g711_ulaw" and deltas[0].sample_rate_hz == 8000
    assert abs(len(body) - 4000) <= 1  # 0.5 s at 8 kHz, one byte a sample
    decoded = ulaw_to_int16(body).astype(np.float32) / 32768
    np.testing.assert_allclose(decoded[400:3600], sine(8000, 0.5)[400:3600], atol=0.03)
    assert len(deltas) == sum(
        e.wire_type == "response.output_audio_transcript.delta" for e in events
    )


async def test_text_append_joins_the_turn(harness):
    session = await harness.open()
    await session.send({"type": "input.text.append", "text": "hi"})
    await session.send({"type": "input_audio_buffer.commit"})
    events = await session.until("conversation.item.done")
    assert events[-1].item["content"] == [{"type": "input_text", "text": "hi"}]


async def test_commands_after_a_commit_see_it_however_slow_the_audio_path(harness):
    """response.create right behind a commit answers that commit, even when the
    commit's audio work is still running when response.create arrives."""
    session = await harness.open()
    runner = harness.manager.table.runner(session.session_id)
    convert = runner.pipeline.convert

    def slow_convert(*args):
        import time

        time.sleep(0.02)  # a loaded machine
        return convert(*args)

    runner.pipeline.convert = slow_convert
    await send_all(session, appends(sine(16000, 0.3), 16000))
    await session.send({"type": "input_audio_buffer.commit"})
    await session.send({"type": "input.text.append", "text": "late"})  # belongs to the next turn
    await session.send({"type": "response.create"})
    events = await session.until("rate_limits.updated")
    assert "error" not in types(events)
    user_item = next(e for e in events if e.wire_type == "conversation.item.added").item
    assert user_item["content"] == [{"type": "input_audio", "transcript": None}]  # no "late" text
    transcript = next(
        e for e in events if e.wire_type == "response.output_audio_transcript.done"
    ).transcript
    assert transcript == "echo 300 ms"
    assert runner.session.input.text == "late"


async def test_f32_speech_verdict_uses_rms_of_the_decoded_input(harness):
    session = await harness.open({"input_audio_format": "pcm_f32le", "extra_body": {"pace": 0}})
    quiet = np.full(1600, 0.001, np.float32).astype("<f4").tobytes()
    await session.send(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(quiet).decode()}
    )
    await session.send({"type": "input_audio_buffer.commit", "event_id": "quiet"})
    events = await session.until("conversation.item.done")
    assert "input_audio_buffer.speech_started" not in types(events)  # below overlap_silence_rms
    loud = (0.2 * np.ones(1600, np.float32)).astype("<f4").tobytes()
    await session.send(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(loud).decode()}
    )
    assert (await session.recv()).wire_type == "input_audio_buffer.speech_started"
