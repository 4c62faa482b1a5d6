"""Session object readers: defaults (4.1), turn detection (4.2), response options (4.3)."""

import contextlib

import numpy as np
import pytest

from shared.protocol.duplex import (
    AudioFormat,
    DuplexSessionConfig,
    RealtimeProtocolError,
    ResponseCreateOptions,
    TurnDetection,
    speech_verdict,
)


def refused(fn, *args, **kwargs) -> RealtimeProtocolError:
    with pytest.raises(RealtimeProtocolError) as info:
        fn(*args, **kwargs)
    return info.value


def test_defaults_are_the_contracts():
    config = DuplexSessionConfig.from_realtime({})
    assert config.model is None
    assert config.modalities == ("text", "audio")
    assert config.response_format == "wav"
    assert (config.temperature, config.max_tokens, config.speed) == (None, None, None)
    assert config.use_tts_template is True
    assert config.idle_timeout_s == 300.0
    assert config.overlap_policy == "listen_only"
    assert (config.overlap_short_ack_ms, config.overlap_barge_in_ms) == (700, 1200)
    assert config.overlap_silence_rms == 0.003
    assert config.playback_commit_policy == "commit_all_on_done"
    assert config.turn_detection is None
    assert config.input_audio_format == AudioFormat("pcm16", 16000)
    assert config.output_audio_format == AudioFormat("pcm16", None)


def test_beta_and_ga_spellings_read_the_same():
    beta = DuplexSessionConfig.from_realtime(
        {
            "input_audio_format": "g711_ulaw",
            "output_audio_format": "pcm16",
            "modalities": ["text"],
            "voice": "v1",
        }
    )
    ga = DuplexSessionConfig.from_realtime(
        {
            "audio": {
                "input": {"format": {"type": "audio/pcmu"}},
                "output": {"format": {"type": "audio/pcm"}, "voice": "v1"},
            },
            "output_modalities": ["text"],
        }
    )
    for config in (beta, ga):
        assert config.input_audio_format == AudioFormat("g711_ulaw", 8000)
        assert config.output_audio_format == AudioFormat("pcm16", None)
        assert (config.modalities, config.voice, config.response_format) == (("text",), "v1", "pcm")


def test_fields_ids_and_extra_body():
    config = DuplexSessionConfig.from_realtime(
        {
            "id": "duplex-client-chosen",
            "session_id": "also-ignored",
            "model": "echo",
            "instructions": "be brief",
            "max_response_output_tokens": "inf",
            "temperature": 0.7,
            "speed": 1.25,
            "idle_timeout_s": 60,
            "tools": [{"name": "t"}],
            "extra_body": {
                "auto_response": False,
                "overlap_short_ack_ms": 500,
                "playback_commit_policy": "ack_only",
            },
            "overlap_silence_rms": 0.01,
        }
    )
    assert (config.model, config.instructions, config.max_tokens) == ("echo", "be brief", None)
    assert (config.temperature, config.speed, config.idle_timeout_s) == (0.7, 1.25, 60.0)
    assert (config.overlap_short_ack_ms, config.overlap_silence_rms) == (500, 0.01)
    assert config.playback_commit_policy == "ack_only"
    assert config.extra_body["realtime_tools"] == [{"name": "t"}]
    assert "id" not in config.extra_body["realtime_session_payload"]
    assert config.model_native is False
    assert DuplexSessionConfig.from_realtime({"max_output_tokens": 64}).max_tokens == 64


def test_unknown_policy_values_normalise():
    config = DuplexSessionConfig.from_realtime({"playback_commit_policy": "whenever"})
    assert config.playback_commit_policy == "commit_all_on_done"
    assert (
        DuplexSessionConfig.from_realtime({"overlap_policy": "shout"}).overlap_policy
        == "listen_only"
    )


UNHASHABLE = ([], ["low"], {}, {"type": "server_vad"})


@pytest.mark.parametrize("bad", UNHASHABLE)
@pytest.mark.parametrize("surface", [{}, {"duplex_surface": "openai"}])
@pytest.mark.parametrize("key", ["eagerness", "type", "create_response", "interrupt_response"])
def test_a_list_or_object_in_a_turn_detection_enum_is_refused(bad, surface, key):
    td = {"type": "semantic_vad", key: bad}
    error = refused(DuplexSessionConfig.from_realtime, {**surface, "turn_detection": td})
    assert (error.code, error.param) == ("unsupported_turn_detection", "turn_detection")


@pytest.mark.parametrize("bad", [*UNHASHABLE, [[]], [{}]])
@pytest.mark.parametrize(
    "key",
    [
        "modalities",
        "output_modalities",
        "input_audio_format",
        "output_audio_format",
        "response_format",
        "voice",
        "max_output_tokens",
        "tool_choice",
        "duplex_surface",
    ],
)
def test_a_list_or_object_in_an_enum_field_is_refused_or_ignored(bad, key):
    """Never a TypeError of a dict lookup: a coded refusal, or a value read as none."""
    for read in (DuplexSessionConfig.from_realtime, ResponseCreateOptions.from_realtime):
        with contextlib.suppress(RealtimeProtocolError):
            read({key: bad})


@pytest.mark.parametrize("bad", UNHASHABLE)
def test_a_list_or_object_policy_normalises(bad):
    config = DuplexSessionConfig.from_realtime(
        {"overlap_policy": bad, "playback_commit_policy": bad}
    )
    assert (config.overlap_policy, config.playback_commit_policy) == (
        "listen_only",
        "commit_all_on_done",
    )


@pytest.mark.parametrize(
    "session, code, param",
    [
        ({"modalities": ["smell"]}, "invalid_session_config", "modalities"),
        ({"max_tokens": 0}, "invalid_session_config", "max_tokens"),
        ({"temperature": "hot"}, "invalid_session_config", "temperature"),
        ({"speed": 0}, "invalid_session_config", "speed"),
        ({"idle_timeout_s": -1}, "invalid_session_config", "idle_timeout_s"),
        ({"instructions": 5}, "invalid_session_config", "instructions"),
        ({"extra_body": []}, "invalid_session_config", "extra_body"),
        ({"input_audio_format": "opus"}, "unsupported_audio_format", "input_audio_format"),
        (
            {"audio": {"output": {"format": {"type": "audio/mp3"}}}},
            "unsupported_audio_format",
            "audio.output.format",
        ),
        (
            {"audio": {"input": {"format": "pcm16", "sample_rate_hz": 4000}}},
            "unsupported_audio_format",
            "audio.input.format",
        ),
    ],
)
def test_invalid_session_fields(session, code, param):
    error = refused(DuplexSessionConfig.from_realtime, session)
    assert (error.code, error.param) == (code, param)


# ---------------------------------------------------------------- 4.2


def test_server_vad_defaults_and_forced_overlap_policy():
    config = DuplexSessionConfig.from_realtime({"turn_detection": {"type": "server_vad"}})
    assert config.turn_detection == TurnDetection()
    assert config.turn_detection.to_realtime() == {
        "type": "server_vad",
        "threshold": 0.5,
        "prefix_padding_ms": 300,
        "silence_duration_ms": 500,
        "min_speech_duration_ms": 96,
        "create_response": True,
        "interrupt_response": True,
    }
    assert config.overlap_policy == "barge_in_on_speech"
    nested = DuplexSessionConfig.from_realtime(
        {"audio": {"input": {"turn_detection": {"threshold": 0.8}}}}
    )
    assert nested.turn_detection.threshold == 0.8 and nested.overlap_policy == "barge_in_on_speech"
    off = DuplexSessionConfig.from_realtime({"turn_detection": None}, base=config)
    assert (off.turn_detection, off.overlap_policy) == (None, "listen_only")
    kept = DuplexSessionConfig.from_realtime({"instructions": "x"}, base=config)
    assert (
        kept.turn_detection == config.turn_detection and kept.overlap_policy == "barge_in_on_speech"
    )


def test_min_speech_duration_has_a_floor():
    td = TurnDetection.from_realtime({"type": "server_vad", "min_speech_duration_ms": 5})
    assert td.min_speech_duration_ms == 32


@pytest.mark.parametrize(
    "td",
    [
        {"type": "semantic_vad", "eagerness": "eager"},
        {"type": "server_vad", "idle_timeout_ms": 0},
        {"type": "server_vad", "idle_timeout_ms": 1.5},
        {"type": "server_vad", "idle_timeout_ms": True},
        {"type": "none"},
        "server_vad",
        {"type": "server_vad", "threshold": 0},
        {"type": "server_vad", "threshold": 1.5},
        {"type": "server_vad", "threshold": True},
        {"type": "server_vad", "interrupt_response": False},
        {"type": "server_vad", "create_response": "yes"},
        {"type": "server_vad", "silence_duration_ms": 0},
        {"type": "server_vad", "prefix_padding_ms": -5},
    ],
)
def test_unsupported_turn_detection(td):
    error = refused(DuplexSessionConfig.from_realtime, {"turn_detection": td})
    assert (error.code, error.param) == ("unsupported_turn_detection", "turn_detection")


@pytest.mark.parametrize(
    "session, base_td",
    [
        ({"turn_detection": {"type": "server_vad"}, "overlap_policy": "listen_only"}, None),
        ({"turn_detection": None, "overlap_policy": "barge_in_on_speech"}, None),
        ({"overlap_policy": "barge_in_on_speech"}, None),
        ({"extra_body": {"overlap_policy": "barge_in_on_speech"}}, None),
        ({"overlap_policy": "listen_only"}, {"type": "server_vad"}),
    ],
)
def test_conflicting_overlap_policy_is_refused(session, base_td):
    base = DuplexSessionConfig.from_realtime({"turn_detection": base_td})
    error = refused(DuplexSessionConfig.from_realtime, session, base=base)
    assert (error.code, error.param) == ("invalid_session_config", "overlap_policy")


def test_format_check_runs_before_turn_detection_check():
    error = refused(
        DuplexSessionConfig.from_realtime,
        {"input_audio_format": "mp3", "turn_detection": {"type": "semantic_vad"}},
    )
    assert error.code == "unsupported_audio_format"


def test_live_update_rules():
    config = DuplexSessionConfig.from_realtime(
        {"model": "echo", "ref_audio": "data:audio/wav;base64,AAAA"}
    )
    assert (
        config.apply_update({"model": "echo", "instructions": "now"}).instructions == "now"
    )  # echo is fine
    assert refused(config.apply_update, {"model": "other"}).code == "model_update_unsupported"
    assert (
        refused(config.apply_update, {"ref_audio": "data:x"}).code == "ref_audio_update_unsupported"
    )
    updated = config.apply_update(
        {"input_audio_format": "pcm16", "audio": {"input": {"sample_rate_hz": 24000}}}
    )
    assert updated.input_audio_format == AudioFormat("pcm16", 24000)
    assert updated.apply_update({"input_audio_format": "pcm16"}).input_audio_format.rate == 24000


def test_rendered_session_object_reads_back_to_the_same_config():
    config = DuplexSessionConfig.from_realtime(
        {
            "model": "echo",
            "instructions": "hi",
            "voice": "v",
            "speed": 1.5,
            "temperature": 0.2,
            "max_tokens": 9,
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 300},
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": 24000}},
                "output": {"format": "g711_alaw"},
            },
        }
    )
    rendered = config.to_realtime()
    assert rendered["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert (
        rendered["input_audio_format"] == "pcm16" and rendered["output_audio_format"] == "g711_alaw"
    )
    again = DuplexSessionConfig.from_realtime(rendered)
    assert again.to_realtime() == rendered
    fields = (
        "model",
        "instructions",
        "voice",
        "speed",
        "temperature",
        "max_tokens",
        "turn_detection",
    )
    assert all(getattr(again, f) == getattr(config, f) for f in fields)
    assert again.input_defaults() == config.input_defaults()


# ---------------------------------------------------------------- 4.3


def test_response_create_options():
    options = ResponseCreateOptions.from_realtime(
        {
            "instructions": "short",
            "audio": {"output": {"voice": "v2", "format": {"type": "audio/pcmu"}}},
            "max_output_tokens": "inf",
            "output_modalities": ["audio"],
            "metadata": {"k": 1},
            "conversation": "none",
            "extra_body": {"keep": 1, "private_key": 2},
        },
        private_keys=frozenset({"private_key"}),
    )
    assert (options.instructions, options.voice, options.max_tokens) == ("short", "v2", None)
    assert options.modalities == ("audio",) and options.output_audio_format == AudioFormat(
        "g711_ulaw", 8000
    )
    assert options.extra_body == {
        "keep": 1,
        "realtime_response_metadata": {"k": 1},
        "realtime_response_conversation": "none",
    }
    error = refused(options.check_native)
    assert (error.code, error.param) == (
        "unsupported_native_response_options",
        "response.instructions",
    )
    ResponseCreateOptions.from_realtime(
        {"metadata": {"a": 1}, "modalities": ["audio"]}
    ).check_native()
    tools = ResponseCreateOptions.from_realtime({"tools": []})
    assert refused(tools.check_native).code == "unsupported_native_response_options"


# ---------------------------------------------------------------- speech verdict


def test_speech_verdict_order():
    loud = np.full(160, 0.1, np.float32)
    quiet = np.full(160, 0.001, np.float32)

    def verdict(is_speech=None, hints=None, encoding="pcm_f32le", samples=quiet):
        return speech_verdict(
            is_speech=is_speech,
            hints=hints or {},
            encoding=encoding,
            samples=samples,
            silence_rms=0.003,
        )

    assert verdict(is_speech=True) is True  # explicit wins over everything
    assert verdict(is_speech=False, samples=loud, hints={"speech_probability": 0.99}) is False
    assert verdict(hints={"speech": True}) is True
    assert verdict(hints={"vad": {"is_speech": False}}, samples=loud) is False
    assert verdict(hints={"speech_probability": 0.5}) is True  # then the VAD probability
    assert verdict(hints={"vad": {"probability": 0.49}}, samples=loud) is False
    assert verdict(samples=loud) is True and verdict(samples=quiet) is False  # then RMS, f32 only
    assert (
        verdict(samples=quiet, hints={"vad": {"silence_rms": 0.0005}}) is True
    )  # per-event threshold
    assert verdict(encoding="pcm16", samples=quiet) is True  # otherwise: speech
