"""The error-code table: classes, retryability, and the envelope it renders."""

import orjson

from shared.protocol.duplex import (
    ERROR_CODES,
    ERROR_TYPES,
    DuplexErrorEvent,
    RealtimeProtocolError,
    error_type_for,
    retryable_for,
)


def test_every_code_has_one_of_the_three_classes():
    assert set(ERROR_TYPES) == {"invalid_request_error", "server_error", "rate_limit_error"}
    assert {entry.error_type for entry in ERROR_CODES.values()} == set(ERROR_TYPES)
    assert all(entry.description for entry in ERROR_CODES.values())


def test_classes_of_the_contract_map():
    assert error_type_for("bad_audio") == "invalid_request_error"
    assert error_type_for("unknown_session") == "invalid_request_error"
    assert error_type_for("runtime_data_plane_stream_failed") == "server_error"
    assert error_type_for("server_vad_unavailable") == "server_error"
    assert error_type_for("resource_exhausted") == "rate_limit_error"
    assert error_type_for("input_backpressure") == "rate_limit_error"
    assert error_type_for("worker_lost") == "server_error"
    # codes outside the map keep the default class
    assert error_type_for("session_resume_conflict") == "invalid_request_error"
    assert error_type_for("never_heard_of_it") == "invalid_request_error"
    assert error_type_for(None) == "invalid_request_error"


def test_retryable_where_the_contract_sets_it():
    retryable = {code for code, entry in ERROR_CODES.items() if entry.retryable}
    assert retryable == {
        "resource_exhausted",
        "timeout",
        "engine_backpressure",
        "worker_lost",
        "input_lost",
    }
    assert retryable_for("bad_audio") is None and retryable_for("unknown") is None


def test_error_event_renders_the_envelope_with_extra_keys():
    event = DuplexErrorEvent.for_code(
        "resource_exhausted",
        "duplex_session_capacity_exhausted: limit=4",
        related_event_id="c1",
        limit=4,
    )
    wire = orjson.loads(event.to_json())
    assert wire["type"] == "error" and wire["event_id"].startswith("event_")
    assert wire["error"] == {
        "type": "rate_limit_error",
        "code": "resource_exhausted",
        "message": "duplex_session_capacity_exhausted: limit=4",
        "event_id": "c1",
        "retryable": True,
        "limit": 4,
    }
    # extra keys never overwrite the envelope's own keys
    clash = DuplexErrorEvent.for_code("bad_event", "m", code_hint="x", type="nope")
    assert orjson.loads(clash.to_json())["error"]["type"] == "invalid_request_error"


def test_from_exception_keeps_code_param_and_event_id():
    exc = RealtimeProtocolError(
        "unsupported_audio_format", "no", param="format", related_event_id="e2"
    )
    event = DuplexErrorEvent.from_exception(exc)
    assert (event.code, event.param, event.related_event_id, event.error_type) == (
        "unsupported_audio_format",
        "format",
        "e2",
        "invalid_request_error",
    )


def test_with_event_id_does_not_overwrite_a_known_id():
    exc = RealtimeProtocolError("bad_event", "m", related_event_id="first")
    assert exc.with_event_id("second").related_event_id == "first"
    assert RealtimeProtocolError("bad_event", "m").with_event_id("x").related_event_id == "x"
