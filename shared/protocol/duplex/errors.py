"""Our error-code vocabulary (Tier 3): every code, its `error.type` class, and retryability.

The envelope shape and the three classes are OpenAI's (Tier 1); the codes are
ours. A code missing from this table renders as `invalid_request_error`
(contract 3), so adding a server-side code here is what makes it a
`server_error` or a `rate_limit_error`.
"""

from __future__ import annotations

import dataclasses

from shared.protocol.realtime.errors import (
    INVALID_REQUEST_ERROR,
    RATE_LIMIT_ERROR,
    SERVER_ERROR,
    CodedError,
    RealtimeProtocolError,
    register_code_table,
)

#: The codes the services name in code: one constant each, here only (a code written as a
#: string elsewhere is still checked against the table: tests/test_errors.py).
WORKER_LOST = "worker_lost"
STREAM_FAILED = "runtime_data_plane_stream_failed"
INPUT_FAILED = "runtime_input_failed"
INTERNAL_ERROR = "internal_error"
NEMOTRON_PARSE_ERROR = "nemotron_function_call_parse_error"
INVALID_VIDEO_FRAMES = "invalid_video_frames"


@dataclasses.dataclass(frozen=True)
class ErrorCode:
    code: str
    error_type: str
    description: str
    retryable: bool | None = None
    #: which table of the contract it comes from (for the docs)
    group: str = "session"


def _codes(
    error_type: str,
    group: str,
    rows: list[tuple[str, str]],
    retryable: frozenset[str] = frozenset(),
) -> list[ErrorCode]:
    return [
        ErrorCode(code, error_type, text, True if code in retryable else None, group)
        for code, text in rows
    ]


_INVALID_REQUEST: list[tuple[str, str]] = [
    (
        "bad_event",
        "not an object, no `type`, or a field of the wrong shape (`param` names it)",
    ),
    ("bad_audio", "audio is not valid base64, or not a whole number of samples"),
    ("config_timeout", "no first message within 10 s of connecting"),
    ("invalid_json", "the frame is not valid JSON"),
    ("event_too_large", "the frame is over 15 MiB (UTF-8); the session continues"),
    ("unknown_event", "unknown client event type"),
    ("context_not_initialized", "the model context is not initialised yet"),
    ("invalid_context_input", "the context input is malformed"),
    ("stale_context_epoch", "the context operation belongs to an older epoch"),
    ("stale_context_version", "the context operation belongs to an older context version"),
    ("stale_task_slate", "the task slate was replaced"),
    ("unknown_function_call", "function output for an unknown call"),
    ("duplicate_function_output", "a second output for the same function call"),
    ("context_event_conflict", "the context event conflicts with the current context"),
    ("gander_context_limit", "the context is over its limit"),
    ("gander_tool_parse_error", "a tool call could not be parsed"),
    ("gander_tool_schema_error", "a tool schema is invalid"),
    ("invalid_tools", "the tools declaration is invalid"),
    ("context_input_unsupported", "this model does not take that context input"),
    ("context_replacement_unsupported", "this model cannot replace its context"),
    ("session_exists", "a session with that id is already open"),
    ("session_closed", "command to a closing session"),
    ("unknown_session", "command, close, touch or resume for a session the server no longer holds"),
    ("invalid_duplex_runtime_config", "the model plugin rejected the session's runtime config"),
    ("instructions_update_unsupported", "instructions cannot change after the context is locked"),
    ("persona_update_unsupported", "the persona cannot change after open"),
    ("voice_update_unsupported", "the voice cannot change after open"),
    ("unsupported_nemotron_duplex_mode", "Nemotron needs extra_body.auto_response=true"),
    (
        "unsupported_native_response_options",
        "per-response instructions/voice/temperature/max tokens/tools in a model-native session",
    ),
    ("response_already_active", "response.create while a response is active"),
    (
        "conversation_already_has_active_response",
        "openai surface (OpenAI's code): response.create while a response is active",
    ),
    ("response_not_active", "cancel with no active response"),
    (
        "response_cancel_not_active",
        "openai surface (OpenAI's code): response.cancel with no active response "
        '(message "Cancellation failed: no active response found")',
    ),
    (
        "response_create_without_input",
        "duplex surface: response.create with no committed audio (and no function output "
        "to answer)",
    ),
    ("text_only_turn_unsupported", "duplex surface: response.create over items only"),
    ("input_audio_buffer_empty", "commit without audio"),
    ("missing_item_id", "item_id is required"),
    ("item_not_found", "no conversation item with that id"),
    ("playback_item_mismatch", "playback.ack names an item of another response"),
    ("playback_item_not_found", "playback.ack for an unknown response or item"),
    ("playback_ack_too_late", "playback.ack for a response superseded by a later commit"),
    ("unsupported_audio_format", "unsupported audio format or sample rate (8 000-192 000 Hz)"),
    (
        "unsupported_turn_detection",
        "turn detection other than server_vad or semantic_vad (eagerness low, medium, high "
        "or auto), a malformed setting, or interrupt_response=false on the duplex surface",
    ),
    ("unsupported_ref_audio_path", "ref_audio paths are not accepted; use a URI or data URL"),
    ("ref_audio_required", "the model needs ref_audio when audio output is on"),
    ("model_update_unsupported", "session.update cannot change the model"),
    ("voice_update_after_audio_unsupported", "the voice cannot change once audio has started"),
    ("ref_audio_update_unsupported", "ref_audio cannot change after open"),
    ("native_text_append_unsupported", "text append in a model-native session"),
    ("invalid_video_frames", "video_frames must be a list of base64 images"),
    ("invalid_function_call_output", "function_call_output needs string call_id and output"),
]

_SERVER: list[tuple[str, str]] = [
    (INTERNAL_ERROR, "unexpected server failure"),
    ("runtime_append_failed", "the model could not take an append (e.g. stale epoch)"),
    ("context_operation_failed", "a context operation failed"),
    ("context_output_failed", "a context output failed"),
    (INPUT_FAILED, "the model could not take an input"),
    ("runtime_append_task_failed", "an append task failed"),
    ("runtime_signal_failed", "a turn signal failed"),
    ("runtime_abort_failed", "aborting a stage request failed"),
    (
        STREAM_FAILED,
        "a model stage failed; the response fails with that reason (a model-native "
        "session whose model slot could not open: the session closes with that reason)",
    ),
    ("runtime_data_plane_text_without_audio", "the model produced text without audio"),
    ("runtime_touch_failed", "refreshing the session lease failed"),
    ("engine_error", "the model engine failed"),
    ("commit_aborted", "a commit was aborted"),
    ("server_vad_unavailable", "server VAD could not be loaded"),
]

_RATE_LIMIT: list[tuple[str, str]] = [
    ("resource_exhausted", "no session slot: `duplex_session_capacity_exhausted: limit=N`"),
    (
        "input_backpressure",
        "pending input over the session's limit (counted as decoded float32 samples at the "
        "model rate, so 16 MiB is about 4.4 minutes at 16 kHz whatever the input encoding; "
        "an append whose payload alone is over it is refused by the API pod), pending turns "
        "over the limit, or (`retryable: true`) the worker's inbox over its budget; the "
        "command is dropped",
    ),
]

_TRANSPORT: list[tuple[str, str]] = [
    ("invalid_session_config", "the session object is invalid (`param` names the field)"),
    ("invalid_session_resume", "session.resume with missing fields or a negative seq"),
    ("session_resume_expired", "resume of an unknown or closed session"),
    (
        "unsupported_session_resume",
        "session.resume not as the first message, or the model cannot resume",
    ),
    (
        "invalid_resume_token",
        "the resume token is not the session's (tokens rotate on every resume; a token "
        "two resumes old is unknown)",
    ),
    (
        "session_resume_conflict",
        "the token was rotated out by the last resume: another attachment won the race, "
        "or took the session over",
    ),
    ("runtime_resume_failed", "the resume could not be completed"),
    ("invalid_event_ack", "session.event_ack with a bad or future seq"),
    ("realtime_input_failed", "the client event could not be handled"),
]

_CONTROL: list[tuple[str, str]] = [
    ("stale_fence", "the control call carried an old fence"),
    ("not_found", "the control call named nothing known"),
    ("invalid_argument", "the control call's argument is invalid"),
    ("timeout", "the control call timed out"),
    ("failed_precondition", "the control call's precondition failed"),
    ("engine_backpressure", "the engine is saturated"),
]

_PLUGIN: list[tuple[str, str]] = [
    ("invalid_voice", "unknown voice for this model"),
    ("model_path_unavailable", "the model's files are unavailable"),
    ("prefill_unavailable", "the model's prefill is unavailable"),
    ("sliding_window_update_unsupported", "window settings cannot change after open"),
    ("invalid_sliding_window_config", "window settings are invalid"),
    ("input_clock_unsupported", "this model has no input clock"),
    (NEMOTRON_PARSE_ERROR, "a Nemotron tool call could not be parsed"),
    ("barge_in_unsupported", "barge_in to a model without supports_barge_in"),
]

# Architecture additions (../shared/docs/architecture.md section 8).
_DISTRIBUTED: list[tuple[str, str]] = [
    (
        WORKER_LOST,
        "the worker serving the session died: its in-flight response failed and the session "
        "goes on on another worker, or, when no worker could take it, the session is closed "
        "(a model-native session's response ends `incomplete` instead, with no error event)",
    ),
    (
        "input_lost",
        "commands sent while the session moved to another worker were lost "
        "(`lost_commands`); append the current turn's audio again (never in a model-native "
        "session: there the lost audio is silence to the model)",
    ),
    (
        "output_overflow",
        "the client read events too slowly (2 MiB / 512 queued); the session is closed",
    ),
]

_ALL: list[ErrorCode] = [
    *_codes(INVALID_REQUEST_ERROR, "session", _INVALID_REQUEST),
    *_codes(SERVER_ERROR, "session", _SERVER),
    *_codes(RATE_LIMIT_ERROR, "session", _RATE_LIMIT, frozenset({"resource_exhausted"})),
    # Outside the reference's map: they keep the default class, invalid_request_error.
    *_codes(INVALID_REQUEST_ERROR, "transport", _TRANSPORT),
    *_codes(
        INVALID_REQUEST_ERROR, "control", _CONTROL, frozenset({"timeout", "engine_backpressure"})
    ),
    *_codes(INVALID_REQUEST_ERROR, "plugin", _PLUGIN),
    *_codes(SERVER_ERROR, "distributed", _DISTRIBUTED, frozenset({WORKER_LOST, "input_lost"})),
]

#: code -> ErrorCode, every code duplex-serve can send.
ERROR_CODES: dict[str, ErrorCode] = {entry.code: entry for entry in _ALL}
if len(ERROR_CODES) != len(_ALL):  # pragma: no cover - a duplicated row is a bug
    raise RuntimeError("duplicate error code in the table")

#: The reference's REALTIME_ERROR_TYPES_BY_CODE plus our additions.
ERROR_TYPES_BY_CODE: dict[str, str] = {entry.code: entry.error_type for entry in _ALL}


def error_type_for(code: str | None) -> str:
    """The `error.type` class of a code; unknown codes are `invalid_request_error`."""
    return ERROR_TYPES_BY_CODE.get(code or "", INVALID_REQUEST_ERROR)


def retryable_for(code: str | None) -> bool | None:
    entry = ERROR_CODES.get(code or "")
    return entry.retryable if entry else None


register_code_table(lambda code: (error_type_for(code), retryable_for(code)))


__all__ = [
    "ERROR_CODES",
    "ERROR_TYPES_BY_CODE",
    "INPUT_FAILED",
    "INTERNAL_ERROR",
    "NEMOTRON_PARSE_ERROR",
    "STREAM_FAILED",
    "WORKER_LOST",
    "CodedError",
    "ErrorCode",
    "RealtimeProtocolError",
    "error_type_for",
    "retryable_for",
]
