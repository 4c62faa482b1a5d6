"""Input transcription: partial transcripts streamed as deltas while the user speaks, never
after the turn ended; `.completed` / `.failed` at the commit; who gets which event."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from harness.sessions import appends, make_harness, send_all, speech_wav, types
from services.worker.engine.handlers import dispatch
from services.worker.engine.transcription import (
    CADENCE_MS,
    PartialPool,
    PartialTranscript,
    StableWords,
)
from shared.protocol.duplex import ClearInput
from tests.worker.session_parts import RATE
from tests.worker.transcribing import (
    Recogniser,
    feed,
    feed_without_waiting,
    loud,
    of,
    quiet,
    settle,
    settle_input_only,
)

DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
FAILED = "conversation.item.input_audio_transcription.failed"
TRANSCRIBED = {"model": "whisper-1"}
#: server VAD that ends a turn after 64 ms of silence (LoudnessVad: loud = speech)
VAD = {"type": "server_vad", "prefix_padding_ms": 0, "min_speech_duration_ms": 64,
       "silence_duration_ms": 64}  # fmt: skip


# ---------------------------------------------------------------- deltas


async def test_deltas_stream_the_stable_words_every_500_ms_of_speech(parts_for):
    plugin = Recogniser(
        ["Hello", "Hello there", "Hello there how", "Hello there, how are you?"],
        final="Hello there, how are you?",
    )
    parts = await parts_for({"turn_detection": VAD, "input_audio_transcription": TRANSCRIBED},
                            plugin, vad=True)  # fmt: skip
    await feed(parts, loud(2000))
    # the whole turn so far, once every CADENCE_MS of new audio
    step = RATE * CADENCE_MS // 1000
    assert plugin.decoded == [step, 2 * step, 3 * step, 4 * step]
    await feed(parts, quiet(100))  # the VAD ends the turn: its commit follows
    await settle(parts)
    events = parts.take_events()
    deltas = of(events, DELTA)
    # a word is sent once two partials agree on it; none is sent twice
    assert [d.delta for d in deltas] == ["Hello", " there", " how"]
    item_id = of(events, "input_audio_buffer.committed")[0].item_id
    assert {(d.item_id, d.content_index) for d in deltas} == {(item_id, 0)}
    kinds = types(events)
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index(DELTA)
    last_delta = max(i for i, kind in enumerate(kinds) if kind == DELTA)
    assert last_delta < kinds.index("input_audio_buffer.speech_stopped")
    completed = of(events, COMPLETED)[0]
    assert (completed.item_id, completed.transcript) == (item_id, "Hello there, how are you?")
    assert completed.usage == {"type": "duration", "seconds": pytest.approx(2.0, abs=0.1)}


async def test_without_transcription_configured_nothing_is_decoded_early(parts_for):
    plugin = Recogniser(["Hello", "Hello there"])
    parts = await parts_for({"turn_detection": VAD}, plugin, vad=True)
    await feed(parts, loud(1200))
    await feed(parts, quiet(100))
    await settle(parts)
    events = parts.take_events()
    assert plugin.decoded == [] and not of(events, DELTA)
    # the duplex surface: the model's own recogniser still reports the committed turn
    assert [e.transcript for e in of(events, COMPLETED)] == ["final words"]


async def test_a_manual_turn_streams_deltas_and_a_stale_partial_is_dropped(parts_for):
    """No turn detection: partials run from the turn's first speech to its commit. A decode
    still running when the turn is committed (or cleared) never becomes a delta."""
    plugin = Recogniser(["one", "one two", "one two three"])
    parts = await parts_for({"input_audio_transcription": TRANSCRIBED}, plugin)
    # the decode the test holds must not hold the commit's resampler flush behind it
    parts.input.partials.pool = PartialPool(ThreadPoolExecutor(1, thread_name_prefix="partials"))
    await feed(parts, loud(1000))
    assert [d.delta for d in of(parts.take_events(), DELTA)] == ["one"]

    plugin.gate = threading.Event()  # the next decode hangs on its executor
    await feed_without_waiting(parts, loud(500))
    assert parts.input.partials.in_flight
    parts.commit(create_response=False)
    await parts.apply(await parts.next_ready())  # the commit, ahead of the decode's result
    assert "input_audio_buffer.committed" in types(parts.take_events())
    plugin.gate.set()
    late = await parts.next_ready()
    assert isinstance(late, PartialTranscript) and late.text == "one two three"
    await parts.apply(late)
    assert parts.take_events() == []  # dropped: its turn is committed

    # the same after a clear: the turn's audio is gone, and so is its partial
    plugin.gate = threading.Event()
    await feed(parts, loud(480))  # a new turn, and a decode due at 500 ms
    await feed_without_waiting(parts, loud(40))
    assert parts.input.partials.in_flight and plugin.decoded == [8000, 16000, 24000]
    await dispatch(parts.ctx, ClearInput())
    await settle_input_only(parts)
    plugin.gate.set()
    await settle(parts)
    assert types(parts.take_events()) == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.cleared",
    ]
    parts.input.partials.pool.executor.shutdown(wait=True)


def test_stable_words_never_retract_what_was_sent():
    words = StableWords()
    assert words.update("I want") is None  # one partial: nothing agreed yet
    assert words.update("I want to go") == "I want"
    assert words.update("I wanted to go") is None  # "want" was sent: not taken back
    assert words.update("I want to go, home") is None  # agrees with the revision on "I" only
    # two partials agree again, past what was sent (punctuation is not a word)
    assert words.update("I want to go home.") == " to go home."
    assert words.update("I want to go home.") is None  # nothing new


# ---------------------------------------------------------------- completed and failed


async def test_a_recogniser_failure_is_reported_and_the_session_goes_on(parts_for):
    plugin = Recogniser(fails=RuntimeError("decoder crashed"))
    parts = await parts_for({}, plugin)
    await feed(parts, loud(300))
    parts.commit(event_id="c1", create_response=True)
    await settle(parts)
    events = parts.take_events()
    kinds = types(events)
    assert kinds[kinds.index("input_audio_buffer.committed") + 1] == FAILED
    failed = of(events, FAILED)[0]
    item_id = of(events, "input_audio_buffer.committed")[0].item_id
    assert (failed.item_id, failed.content_index) == (item_id, 0)
    assert failed.error["type"] == "server_error"
    assert failed.error["code"] == "transcription_failed"
    assert "decoder crashed" in failed.error["message"]
    assert "error" not in kinds and COMPLETED not in kinds
    # the turn is committed without a transcript and answered
    assert of(events, "conversation.item.done")[0].item["content"][0]["transcript"] is None
    assert "response.created" in kinds and parts.port.plans[-1].payload.transcript

    await parts.responses.advance_epoch("client_cancelled")
    plugin.fails = None  # the next turn is recognised again
    await feed(parts, loud(300))
    parts.commit(create_response=False)
    await settle(parts)
    assert [e.transcript for e in of(parts.take_events(), COMPLETED)] == ["final words"]


@pytest.mark.parametrize(
    ("session", "reported"),
    [
        ({}, True),  # duplex surface, not mentioned: the model's recogniser reports
        ({"input_audio_transcription": None}, False),  # turned off
        ({"audio": {"input": {"transcription": None}}}, False),
        ({"audio": {"input": {"transcription": TRANSCRIBED}}}, True),
        ({"duplex_surface": "openai"}, False),  # GA: only when configured
        ({"duplex_surface": "openai", "input_audio_transcription": TRANSCRIBED}, True),
    ],
)
async def test_who_gets_transcription_events(parts_for, session, reported):
    plugin = Recogniser(fails=None)
    parts = await parts_for(session, plugin)
    await feed(parts, loud(100))
    parts.commit(create_response=False)
    await settle(parts)
    events = parts.take_events()
    assert bool(of(events, COMPLETED)) is reported
    # the item keeps what the model heard either way (its history needs it)
    assert of(events, "conversation.item.done")[0].item["content"][0]["transcript"] == (
        "final words"
    )
    plugin.fails = RuntimeError("boom")
    await feed(parts, loud(100))
    parts.commit(create_response=False)
    await settle(parts)
    assert bool(of(parts.take_events(), FAILED)) is reported


# ---------------------------------------------------------------- through the runner


async def test_deltas_and_the_transcript_through_the_session_runner():
    """The runner routes partial results from its mailbox: real Silero VAD on speech."""
    plugin = Recogniser(["Hello", "Hello there", "Hello there, can"], final="Hello there.")
    h = make_harness(plugin=plugin)
    try:
        session = await h.open(
            {
                "turn_detection": {"type": "server_vad"},
                "input_audio_transcription": TRANSCRIBED,
                "extra_body": {"pace": 0},
            }
        )
        speech, rate = speech_wav()
        padded = np.concatenate([quiet(300), speech, quiet(1000)])
        await send_all(session, appends(padded, rate))
        events = await session.until(COMPLETED)
        kinds = types(events)
        deltas = of(events, DELTA)
        assert deltas and "".join(d.delta for d in deltas).startswith("Hello")
        assert kinds.index("input_audio_buffer.speech_started") < kinds.index(DELTA)
        assert max(i for i, k in enumerate(kinds) if k == DELTA) < kinds.index(
            "input_audio_buffer.committed"
        )
        assert events[-1].transcript == "Hello there."
    finally:
        await h.manager.shutdown()
