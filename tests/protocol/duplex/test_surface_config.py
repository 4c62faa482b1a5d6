"""The two surfaces' session configs, and turn detection's GA fields (semantic_vad,
eagerness, idle_timeout_ms, interrupt_response)."""

import pytest

from shared.protocol.duplex import (
    BARGE_IN_ON_SPEECH,
    LISTEN_ONLY,
    SEMANTIC_VAD_SILENCE_MS,
    AudioFormat,
    DuplexSessionConfig,
    RealtimeProtocolError,
    TurnDetection,
)

OPENAI = {"duplex_surface": "openai"}


def test_the_duplex_surface_keeps_the_contract_defaults():
    config = DuplexSessionConfig.from_realtime({})
    assert (config.surface, config.openai_surface) == ("duplex", False)
    assert config.turn_detection is None and config.overlap_policy == LISTEN_ONLY
    assert config.input_audio_format == AudioFormat("pcm16", 16000)
    assert config.output_audio_format == AudioFormat("pcm16", None)
    assert "duplex_surface" not in config.to_realtime()


def test_the_openai_surface_has_ga_defaults():
    config = DuplexSessionConfig.from_realtime(OPENAI)
    assert (config.surface, config.openai_surface) == ("openai", True)
    assert config.turn_detection == TurnDetection()  # server_vad, GA's default
    assert config.overlap_policy == BARGE_IN_ON_SPEECH
    assert config.input_audio_format == config.output_audio_format == AudioFormat("pcm16", 24000)
    assert "duplex_surface" not in config.extra_body["realtime_session_payload"]


def test_explicit_null_turns_detection_off_on_the_openai_surface():
    config = DuplexSessionConfig.from_realtime({**OPENAI, "turn_detection": None})
    assert config.turn_detection is None and config.overlap_policy == LISTEN_ONLY
    nested = {**OPENAI, "audio": {"input": {"turn_detection": None}}}
    assert DuplexSessionConfig.from_realtime(nested).turn_detection is None


def test_a_format_without_rate_keeps_24_khz_on_the_openai_surface():
    config = DuplexSessionConfig.from_realtime({**OPENAI, "input_audio_format": "pcm16"})
    assert config.input_audio_format == AudioFormat("pcm16", 24000)


def test_an_update_keeps_the_surface():
    config = DuplexSessionConfig.from_realtime(OPENAI)
    updated = config.apply_update({"duplex_surface": "duplex", "instructions": "hi"})
    assert updated.openai_surface and updated.turn_detection == config.turn_detection
    duplex = DuplexSessionConfig.from_realtime({}).apply_update(OPENAI)
    assert not duplex.openai_surface and duplex.turn_detection is None


def test_the_realtime_form_restores_the_surface():
    """A checkpoint stores `to_realtime()` and reads it back with `from_realtime`."""
    td = {"type": "semantic_vad", "eagerness": "high", "interrupt_response": False}
    config = DuplexSessionConfig.from_realtime({**OPENAI, "turn_detection": td})
    restored = DuplexSessionConfig.from_realtime(config.to_realtime())
    assert restored.surface == "openai"
    assert restored.turn_detection == config.turn_detection
    assert restored.input_audio_format == config.input_audio_format


def test_an_unknown_surface_is_refused():
    with pytest.raises(RealtimeProtocolError) as info:
        DuplexSessionConfig.from_realtime({"duplex_surface": "beta"})
    assert (info.value.code, info.value.param) == ("invalid_session_config", "duplex_surface")


@pytest.mark.parametrize("surface", [{}, OPENAI])
@pytest.mark.parametrize("eagerness", ["low", "medium", "high", "auto", None])
def test_semantic_vad_is_accepted_on_both_surfaces(surface, eagerness):
    td = {"type": "semantic_vad", "create_response": True, "interrupt_response": True}
    if eagerness is not None:
        td["eagerness"] = eagerness
    config = DuplexSessionConfig.from_realtime({**surface, "turn_detection": td})
    stored = config.turn_detection
    assert (stored.type, stored.eagerness) == ("semantic_vad", eagerness or "auto")
    assert stored.silence_duration_ms == SEMANTIC_VAD_SILENCE_MS[eagerness or "auto"]
    assert config.overlap_policy == BARGE_IN_ON_SPEECH


def test_semantic_vad_silence_follows_eagerness():
    assert SEMANTIC_VAD_SILENCE_MS == {"low": 1500, "medium": 800, "auto": 800, "high": 300}


@pytest.mark.parametrize("idle", [None, 1, 6000])
def test_idle_timeout_ms_is_stored(idle):
    td = TurnDetection.from_realtime({"type": "server_vad", "idle_timeout_ms": idle})
    assert td.idle_timeout_ms == idle
    assert ("idle_timeout_ms" in td.to_realtime()) is (idle is not None)


def test_null_fields_mean_their_defaults():
    td = TurnDetection.from_realtime(
        {"type": "server_vad", "threshold": None, "silence_duration_ms": None, "eagerness": None}
    )
    assert td == TurnDetection()


def test_interrupt_response_false_only_on_the_openai_surface():
    td = {"type": "server_vad", "interrupt_response": False}
    with pytest.raises(RealtimeProtocolError) as info:
        DuplexSessionConfig.from_realtime({"turn_detection": td})
    assert info.value.code == "unsupported_turn_detection"
    config = DuplexSessionConfig.from_realtime({**OPENAI, "turn_detection": td})
    assert config.turn_detection.interrupt_response is False
    updated = DuplexSessionConfig.from_realtime(OPENAI).apply_update({"turn_detection": td})
    assert updated.turn_detection.interrupt_response is False
