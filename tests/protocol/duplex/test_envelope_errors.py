"""Envelope and field errors come back with the contract code, param and client event_id."""

import base64

import orjson
import pytest

from shared.protocol.duplex import (
    MAX_EVENT_BYTES,
    AppendAudio,
    CommandContext,
    DuplexErrorEvent,
    InputAudioDefaults,
    RealtimeProtocolError,
    parse_client_event,
)
from shared.protocol.realtime.formats import AudioFormat


def rejection(frame, ctx=None):
    ctx = ctx or CommandContext()
    with pytest.raises(RealtimeProtocolError) as info:
        parse_client_event(frame, ctx)
    return info.value


@pytest.mark.parametrize(
    "frame, code, param",
    [
        ("{", "invalid_json", None),
        ("", "invalid_json", None),
        ('{"type": "session.update",}', "invalid_json", None),
        ("NaN", "invalid_json", None),
        ("[]", "bad_event", None),
        ('"input_audio_buffer.append"', "bad_event", None),
        ("42", "bad_event", None),
        ("{}", "bad_event", "type"),
        ('{"type": 7}', "bad_event", "type"),
        ('{"type": ""}', "bad_event", "type"),
        ('{"type": "response.explode"}', "unknown_event", "type"),
        (
            '{"type": "input.audio.append"}',
            "unknown_event",
            "type",
        ),  # pre-Realtime spelling: old versions only
    ],
)
def test_envelope_errors(frame, code, param):
    error = rejection(frame)
    assert (error.code, error.param) == (code, param)


def test_event_too_large_counts_utf8_bytes_not_characters():
    filler = "é" * (MAX_EVENT_BYTES // 2)  # 2 bytes each: exactly the limit in UTF-8 ...
    at_limit = '{"type":"x","p":"' + filler[: (MAX_EVENT_BYTES - 20) // 2] + '"}'
    assert len(at_limit.encode()) <= MAX_EVENT_BYTES
    assert rejection(at_limit).code == "unknown_event"  # parsed: under the limit
    over = '{"type":"x","p":"' + filler + '"}'
    assert len(over) < MAX_EVENT_BYTES < len(over.encode())
    assert rejection(over).code == "event_too_large"
    assert rejection(over.encode()).code == "event_too_large"


def test_unknown_event_echoes_the_client_event_id():
    error = rejection('{"type": "nope", "event_id": "client-7"}')
    assert (error.code, error.related_event_id) == ("unknown_event", "client-7")
    wire = orjson.loads(DuplexErrorEvent.from_exception(error).to_json())
    assert wire["error"] == {
        "type": "invalid_request_error",
        "code": "unknown_event",
        "message": "unknown client event type 'nope'",
        "param": "type",
        "event_id": "client-7",
    }


@pytest.mark.parametrize(
    "event, code, param",
    [
        ({"type": "input_audio_buffer.append", "audio": "not base64!"}, "bad_audio", "audio"),
        (
            {"type": "input_audio_buffer.append", "audio": "QUJD"},
            "bad_audio",
            "audio",
        ),  # 3 bytes of pcm16
        ({"type": "input_audio_buffer.append", "audio": 17}, "bad_audio", "audio"),
        (
            {"type": "input_audio_buffer.append", "audio": "AAAAAA==", "format": "mp3"},
            "unsupported_audio_format",
            "format",
        ),
        (
            {"type": "input_audio_buffer.append", "audio": "AAAAAA==", "sample_rate_hz": 7999},
            "unsupported_audio_format",
            "sample_rate_hz",
        ),
        (
            {"type": "input_audio_buffer.append", "audio": "AAAAAA==", "sample_rate_hz": 192001},
            "unsupported_audio_format",
            "sample_rate_hz",
        ),
        (
            {
                "type": "input_audio_buffer.append",
                "audio": "AAAAAA==",
                "format": {"type": "audio/pcm", "rate": 44100.5},
            },
            "unsupported_audio_format",
            "format",
        ),
        (
            {"type": "input_audio_buffer.append", "audio": "AAAAAA==", "video_frames": ["%%%"]},
            "invalid_video_frames",
            "video_frames[0]",
        ),
        (
            {"type": "input_audio_buffer.append", "audio": "AAAAAA==", "video_frames": "x"},
            "invalid_video_frames",
            "video_frames",
        ),
        (
            {"type": "input_audio_buffer.append", "audio": "AAAAAA==", "is_speech": "yes"},
            "bad_event",
            "is_speech",
        ),
        (
            {"type": "input_audio_buffer.append", "audio": "AAAAAA==", "duration_ms": -1},
            "bad_event",
            "duration_ms",
        ),
        (
            {"type": "input_audio_buffer.commit", "create_response": "no"},
            "bad_event",
            "create_response",
        ),
        ({"type": "conversation.item.delete"}, "missing_item_id", "item_id"),
        ({"type": "conversation.item.delete", "item_id": ""}, "missing_item_id", "item_id"),
        ({"type": "conversation.item.truncate", "audio_end_ms": 5}, "missing_item_id", "item_id"),
        ({"type": "conversation.item.truncate", "item_id": "i"}, "bad_event", "audio_end_ms"),
        (
            {"type": "conversation.item.truncate", "item_id": "i", "audio_end_ms": "5"},
            "bad_event",
            "audio_end_ms",
        ),
        (
            {
                "type": "conversation.item.truncate",
                "item_id": "i",
                "audio_end_ms": 5,
                "content_index": -1,
            },
            "bad_event",
            "content_index",
        ),
        ({"type": "conversation.item.create"}, "bad_event", "item"),
        ({"type": "conversation.item.create", "item": []}, "bad_event", "item"),
        (
            {"type": "conversation.item.create", "item": {"type": "picture"}},
            "bad_event",
            "item.type",
        ),
        ({"type": "conversation.item.create", "item": {"role": "robot"}}, "bad_event", "item.role"),
        (
            {
                "type": "conversation.item.create",
                "item": {"role": "user", "content": [{"type": "output_audio"}]},
            },
            "bad_event",
            "item.content[0]",
        ),
        (
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": "c"},
            },
            "invalid_function_call_output",
            "item",
        ),
        ({"type": "session.update", "session": "fast"}, "bad_event", "session"),
        ({"type": "response.create", "response": []}, "bad_event", "response"),
        ({"type": "input.text.append"}, "bad_event", "text"),
        ({"type": "input.text.append", "text": 3}, "bad_event", "text"),
        ({"type": "turn.signal"}, "bad_event", "event"),
        ({"type": "turn.signal", "event": "x", "payload": []}, "bad_event", "payload"),
        (
            {"type": "turn.signal", "event": "conversation.item.delete", "payload": {}},
            "missing_item_id",
            "item_id",
        ),
        ({"type": "playback.ack"}, "bad_event", "played_ms"),
        ({"type": "playback.ack", "played_ms": True}, "bad_event", "played_ms"),
        ({"type": "playback.ack", "played_ms": 5, "committed_ms": -2}, "bad_event", "committed_ms"),
        ({"type": "playback.ack", "played_ms": 5, "truncate": 1}, "bad_event", "truncate"),
        ({"type": "session.close", "reason": 5}, "bad_event", "reason"),
        ({"type": "session.resume", "resume_token": "t"}, "invalid_session_resume", "session_id"),
        ({"type": "session.resume", "session_id": "s"}, "invalid_session_resume", "resume_token"),
        (
            {
                "type": "session.resume",
                "session_id": "s",
                "resume_token": "t",
                "last_received_server_event_seq": -1,
            },
            "invalid_session_resume",
            "last_received_server_event_seq",
        ),
        ({"type": "session.event_ack"}, "invalid_event_ack", "server_event_seq"),
        (
            {"type": "session.event_ack", "server_event_seq": "3"},
            "invalid_event_ack",
            "server_event_seq",
        ),
        (
            {"type": "session.event_ack", "server_event_seq": 1.5},
            "invalid_event_ack",
            "server_event_seq",
        ),
        ({"type": "conversation.item.retrieve"}, "missing_item_id", "item_id"),
    ],
)
def test_field_errors(event, code, param):
    event = {**event, "event_id": "evt-1"}
    error = rejection(orjson.dumps(event))
    assert (error.code, error.param, error.related_event_id) == (code, param, "evt-1")


def test_append_uses_the_sessions_declared_format_and_rate():
    ctx = CommandContext(InputAudioDefaults(input_format=AudioFormat("g711_ulaw", 8000)))
    append = parse_client_event('{"type":"input_audio_buffer.append","audio":"/w=="}', ctx)
    assert isinstance(append, AppendAudio)
    assert (append.format, append.sample_rate_hz, append.audio) == ("g711_ulaw", 8000, b"\xff")
    # same encoding without a rate keeps the session's rate; another encoding gets its own default
    ctx24 = CommandContext(InputAudioDefaults(input_format=AudioFormat("pcm16", 24000)))
    same = parse_client_event(
        '{"type":"input_audio_buffer.append","audio":"AAAAAA==","format":"s16le"}', ctx24
    )
    other = parse_client_event(
        '{"type":"input_audio_buffer.append","audio":"AAAAAA==","format":"f32le"}', ctx24
    )
    rate_only = parse_client_event(
        '{"type":"input_audio_buffer.append","audio":"AAAAAA==","sample_rate":48000}', ctx24
    )
    ga = parse_client_event(
        '{"type":"input_audio_buffer.append","audio":"AAAAAA==","format":{"type":"audio/pcmu"}}',
        ctx24,
    )
    assert (same.format, same.sample_rate_hz) == ("pcm16", 24000)
    assert (other.format, other.sample_rate_hz) == ("pcm_f32le", 16000)
    assert (rate_only.format, rate_only.sample_rate_hz) == ("pcm16", 48000)
    assert (ga.format, ga.sample_rate_hz) == ("g711_ulaw", 8000)


def test_append_hints_video_and_wav_payloads():
    wav = b"RIFF\x26\x00\x00\x00WAVEfmt " + bytes(16) + b"data\x01\x00\x00\x00\x00"
    append = parse_client_event(
        orjson.dumps(
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(wav).decode(),  # odd length is fine: it is a WAV file
                "speech_probability": 0.9,
                "vad": {"silence_rms": 0.01},
                "hints": {"force_listen": True, "is_speech": False},
                "video_frames": ["data:image/jpeg;base64,QUJD", "REVG"],
                "duration_ms": 20,
                "unrelated": 1,
            }
        )
    )
    assert append.hints == {
        "speech_probability": 0.9,
        "vad": {"silence_rms": 0.01},
        "force_listen": True,
    }
    assert append.is_speech is False and append.duration_ms == 20
    assert append.video_frames == ("QUJD", "REVG")


def test_aliases_and_remaps():
    commit = parse_client_event('{"type":"input.commit"}')
    assert (commit.wire_type, commit.create_response) == ("input_audio_buffer.commit", True)
    assert parse_client_event('{"type":"input_audio_buffer.commit"}').create_response is None
    assert (
        parse_client_event('{"type":"input.commit","response_create":false}').create_response
        is False
    )
    assert (
        parse_client_event('{"type":"audio.playback_ack","played_ms":40}').wire_type
        == "playback.ack"
    )
    for alias in ("close", "close_session"):
        assert parse_client_event(f'{{"type":"{alias}"}}').reason == "client_close"
    for alias in ("input_text.append", "push_text"):
        assert parse_client_event(f'{{"type":"{alias}","text":"hi"}}').text == "hi"
    assert (
        parse_client_event('{"type":"signal_turn","event":"user_started"}').event == "user_started"
    )
    remapped = {
        "input.cancel": ({}, "input.cancel"),
        "barge_in": ({}, "barge_in"),
        "response.cancel": ({"response_id": "r1"}, "response.cancel"),
        "session.update": ({"session": {"instructions": "x"}}, "session.update"),
        "conversation.item.create": (
            {"item": {"role": "user", "content": []}},
            "conversation.item.create",
        ),
        "conversation.item.delete": ({"item_id": "i"}, "conversation.item.delete"),
        "conversation.item.truncate": (
            {"item_id": "i", "audio_end_ms": 3},
            "conversation.item.truncate",
        ),
    }
    for event, (payload, target) in remapped.items():
        frame = {"type": "turn.signal", "event": event, "payload": payload, "event_id": "e9"}
        command = parse_client_event(orjson.dumps(frame))
        assert (command.wire_type, command.event_id) == (target, "e9")
    assert (
        parse_client_event(
            '{"type":"turn.signal","event":"response.cancel","payload":{"response_id":"r1"}}'
        ).response_id
        == "r1"
    )


def test_session_update_without_session_key_uses_the_payload():
    command = parse_client_event(
        '{"type":"session.update","instructions":"be brief","event_id":"e"}'
    )
    assert command.patch == {"instructions": "be brief"}


@pytest.mark.parametrize("depth", [65, 300, 1000])
def test_events_nested_too_deep_are_invalid_json(depth):
    """Nesting orjson decodes but cannot encode again (found by bench/fuzz.py: the API
    failed re-encoding such an event for the worker and closed with internal_error)."""
    frame = '{"type":"session.update","session":{"x":' + "[" * depth + "]" * depth + "}}"
    assert rejection(frame).code == "invalid_json"


def test_nesting_at_the_limit_is_parsed_and_encodes_again():
    from shared.protocol.realtime.envelope import MAX_JSON_DEPTH, decode_client_frame

    inner = MAX_JSON_DEPTH - 1  # the event object itself is one level
    frame = '{"type":"session.heartbeat","x":' + "[" * inner + "]" * inner + "}"
    event = decode_client_frame(frame, max_bytes=MAX_EVENT_BYTES)
    assert orjson.loads(orjson.dumps(event)) == event
