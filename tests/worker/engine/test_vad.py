"""Server VAD: Silero ONNX on real speech, turn ends, and barge-in by speech."""

import numpy as np
import pytest

from harness.sessions import appends, make_harness, send_all, speech_wav, types
from services.worker.engine.vad import (
    ServerVadDetector,
    SileroOnnxBackend,
    VadUnavailable,
    silero_model_path,
)
from shared.contracts import TurnDetection

VAD_SESSION = {"turn_detection": {"type": "server_vad"}, "extra_body": {"pace": 1}}


def padded_speech(lead_s: float = 0.5, tail_s: float = 1.0) -> np.ndarray:
    speech, rate = speech_wav()
    assert rate == 16000
    return np.concatenate(
        [np.zeros(int(lead_s * rate), np.float32), speech, np.zeros(int(tail_s * rate), np.float32)]
    )


def test_silero_model_ships_in_the_package():
    assert silero_model_path().endswith("silero_vad.onnx")
    with pytest.raises(VadUnavailable):
        SileroOnnxBackend("/nonexistent/model.onnx")


def test_detector_finds_the_utterance_in_any_chunking():
    audio = padded_speech()
    backend = SileroOnnxBackend.shared()
    results = []
    for chunk in (320, 512, 1000, len(audio)):
        detector = ServerVadDetector(backend, TurnDetection())
        events = []
        for start in range(0, len(audio), chunk):
            events += detector.process(audio[start : start + chunk])
        results.append(events)
    assert all(events == results[0] for events in results)  # chunk boundaries do not matter
    started, stopped = results[0]
    assert (started.kind, stopped.kind) == ("started", "stopped")
    # speech starts ~0.5 s in; the report is prefix_padding_ms (300) earlier
    assert 150 <= started.audio_ms <= 400
    assert 2000 <= stopped.audio_ms <= 2800  # 0.5 s lead + ~2.2 s of speech


def test_detector_settings_matter():
    audio = padded_speech()
    long_words = ServerVadDetector(
        SileroOnnxBackend.shared(), TurnDetection(min_speech_duration_ms=3000)
    )
    assert long_words.process(audio) == []  # no 3 s stretch of uninterrupted speech
    patient = ServerVadDetector(SileroOnnxBackend.shared(), TurnDetection(silence_duration_ms=5000))
    assert [e.kind for e in patient.process(audio)] == [
        "started"
    ]  # 1 s of tail silence is not enough


def test_detector_is_silent_on_silence_and_noise():
    rng = np.random.default_rng(7)
    detector = ServerVadDetector(SileroOnnxBackend.shared(), TurnDetection())
    assert detector.process(np.zeros(32000, np.float32)) == []
    assert detector.process((0.001 * rng.standard_normal(32000)).astype(np.float32)) == []


async def test_vad_ends_the_turn_and_speech_barges_in():
    h = make_harness()
    try:
        session = await h.open(VAD_SESSION)
        await send_all(session, appends(padded_speech(), 16000))
        events = await session.until("response.output_audio.delta")
        assert types(events)[:7] == [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.speech_stopped",
            "conversation.item.added",
            "conversation.item.created",
            "input_audio_buffer.committed",
            "conversation.item.done",
            "response.created",
        ]
        started, stopped = events[0], events[1]
        assert started.item_id == stopped.item_id == events[4].item_id
        first_response = events[6].response_id

        # the user speaks over the (real-time) echo: server VAD barges in
        await send_all(session, appends(padded_speech(lead_s=0.2), 16000))
        events = await session.until("response.created")
        kinds = types(events)
        barge = kinds.index("input_audio_buffer.speech_started")
        assert kinds[barge : barge + 2] == ["input_audio_buffer.speech_started", "overlap.decision"]
        overlap = events[barge + 1]
        assert (overlap.action, overlap.policy, overlap.reason) == (
            "barge_in",
            "barge_in_on_speech",
            "server_vad_utterance_active",
        )
        done = next(e for e in events if e.wire_type == "response.done")
        assert done.response_id == first_response
        assert (
            done.response["status"] == "cancelled"
            and done.response["status_details"]["reason"] == "barge_in"
        )
        after_done = kinds[kinds.index("response.done") :]
        assert (
            "response.output_audio.delta" not in after_done[: after_done.index("response.created")]
        )
        assert events[-1].response_id != first_response  # the new turn gets its own response
    finally:
        await h.manager.shutdown()


async def test_without_vad_speech_during_a_response_is_only_reported():
    h = make_harness()
    try:
        session = await h.open({"extra_body": {"pace": 1}})
        await send_all(session, appends(padded_speech(tail_s=0), 16000))
        await session.send({"type": "input.commit"})
        await session.until("response.output_audio.delta")
        await send_all(session, appends(padded_speech(lead_s=0, tail_s=0), 16000))
        events = await session.until("overlap.decision")
        assert (events[-1].action, events[-1].policy) == ("listen", "listen_only")
        await session.send({"type": "response.cancel"})
        done = next(
            e for e in await session.until("response.done") if e.wire_type == "response.done"
        )
        assert done.response["status_details"]["reason"] == "client_cancelled"
    finally:
        await h.manager.shutdown()
