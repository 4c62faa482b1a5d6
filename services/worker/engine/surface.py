"""The openai surface: a session opened on plain `/v1/realtime` speaks OpenAI Realtime GA.

The session runs exactly as a duplex one; only what it sends differs. `project` is called
on every event a runner emits (`SessionManager._emitter`) for a session whose
`config.openai_surface` is set, and returns the event as GA has it, or None when GA has
no such event. The journal then holds the surface's own events, without
`server_event_seq` (the publisher leaves it out for this surface; the seq travels in the
live header): the API pod forwards them as they are (it only closes the socket on a
closure notice instead of sending it).

What the projection does (docs/wire-api.md, "The openai surface"):

- Tier 3 events (`response.speak`, `response.listen`, `overlap.decision`, `turn.event`,
  `duplex.*`, ...) are dropped. The closures (`session.closed`, `session.expired`) do not
  pass here: the manager journals them for the API pod, which closes the socket on them.
- `input_audio_buffer.speech_started` / `speech_stopped` are dropped while turn detection
  is off (GA sends them only from its VAD).
- `session.created` / `session.updated` carry GA's session object (`session_object`).
- `response.created` / `response.done` carry GA's response object: `metadata` is the
  client's `response.create` metadata (or null), `max_output_tokens` is the limit the
  response ran under ("inf": none), `status_details` maps our reasons with
  `CANCELLED_REASONS` (an incomplete response's, `max_output_tokens`, is GA's own),
  `response.done` has a zero `usage`.
- Tier 2 keys go: `format`, `sample_rate_hz`, `metadata` of audio deltas (built GA's
  way from the start by `response.audio_events`, where the runner knows the surface), `event` of
  committed / deleted / truncated, the top-level `response_id` of response events.
- `conversation.item.input_audio_transcription.completed` gets GA's required `usage`.

And one rule on the way in (`client_command`, from `SessionManager.submit`): a client's
commit creates no response, as in GA.

What the surface changes beyond the projection, where the worker decides it (each reads
`config.openai_surface`): a response's message item is announced at its first output,
`response.output_item.added` first (response_controller.py, response.py); a
`response.create` with no committed audio is answered from the conversation, and the
refusals of a cancel or create carry GA's codes (handlers.py).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from shared.protocol.duplex import (
    ERROR_CODES,
    RAW_EVENT_PREFIX,
    SEMANTIC_VAD,
    SERVER_EVENT_TIERS,
    AudioFormat,
    Commit,
    DuplexCommand,
    DuplexEvent,
    DuplexSessionConfig,
    RealtimeProtocolError,
    ResponseCreateOptions,
    TurnDetection,
    error_type_for,
)

if TYPE_CHECKING:
    from services.worker.engine.engine_session import EngineSession
    from services.worker.engine.response import ActiveResponse

JSON = dict[str, Any]

#: A cancelled response's reason (ours, the duplex surface's) -> GA `status_details.reason`.
#: GA knows four: turn_detected, client_cancelled, max_output_tokens, content_filter. A
#: reason not listed here (shutdown: the worker's drain deadline, dropped, ...) renders as
#: `reason: null`, which GA's type allows.
CANCELLED_REASONS: dict[str, str] = {
    "barge_in": "turn_detected",  # the server VAD heard speech over the response
    "new_response": "turn_detected",  # a new turn's response replaced it
    "client_cancelled": "client_cancelled",  # response.cancel, output_audio_buffer.clear
    "input_cancelled": "client_cancelled",  # input.cancel (duplex surface only)
    "client_close": "client_cancelled",
    "disconnect": "client_cancelled",
}
#: GA's `usage` of a response: we do not meter tokens (rate_limits.updated is empty too)
NO_USAGE: JSON = {
    "total_tokens": 0,
    "input_tokens": 0,
    "output_tokens": 0,
    "input_token_details": {
        "text_tokens": 0,
        "audio_tokens": 0,
        "image_tokens": 0,
        "cached_tokens": 0,
        "cached_tokens_details": {"text_tokens": 0, "audio_tokens": 0, "image_tokens": 0},
    },
    "output_token_details": {"text_tokens": 0, "audio_tokens": 0},
}
NO_TRANSCRIPTION_USAGE: JSON = {
    "type": "tokens",
    "input_tokens": 0,
    "output_tokens": 0,
    "total_tokens": 0,
}
#: GA's limits on `metadata` (a string -> string map)
METADATA_MAX_KEYS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512
_SPEECH_TYPES = frozenset(
    {"input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"}
)


# ---------------------------------------------------------------- rendering


def status_details(status: str, reason: str | None) -> JSON | None:
    """GA's `status_details` of a response that ended with our `reason`."""
    if status == "cancelled":
        return {"type": "cancelled", "reason": CANCELLED_REASONS.get(reason or "")}
    if status == "incomplete":  # our reason is GA's own: max_output_tokens
        return {"type": "incomplete", "reason": reason}
    if status == "failed":
        code = reason or "internal_error"
        entry = ERROR_CODES.get(code)
        error = {"type": error_type_for(code), "code": code}
        if entry is not None:
            error["message"] = entry.description
        return {"type": "failed", "error": error}
    return None  # completed, in_progress


def output_modalities(modalities: Any) -> list[str]:
    """GA answers with audio (and its transcript) or with text, never both."""
    return ["audio"] if "audio" in (modalities or ()) else ["text"]


def audio_format(fmt: AudioFormat) -> JSON:
    out = fmt.to_ga()
    if fmt.is_g711:
        out.pop("rate", None)  # GA's audio/pcmu and audio/pcma have no rate
    return out


def turn_detection(td: TurnDetection | None) -> JSON | None:
    if td is None:
        return None
    flags = {"create_response": td.create_response, "interrupt_response": td.interrupt_response}
    if td.type == SEMANTIC_VAD:
        return {"type": SEMANTIC_VAD, "eagerness": td.eagerness or "auto", **flags}
    return {
        "type": td.type,
        "threshold": td.threshold,
        "prefix_padding_ms": int(td.prefix_padding_ms),
        "silence_duration_ms": int(td.silence_duration_ms),
        "idle_timeout_ms": td.idle_timeout_ms,
        **flags,
    }


def _input_setting(extra: Mapping[str, Any], key: str, beta_key: str) -> Any:
    """A GA `audio.input.<key>` the client set, else its beta top-level spelling."""
    audio = extra.get("realtime_audio")
    nested = audio.get("input") if isinstance(audio, Mapping) else None
    if isinstance(nested, Mapping) and key in nested:
        return nested[key]
    return extra.get(f"realtime_{beta_key}")


def session_object(config: DuplexSessionConfig, session_id: str) -> JSON:
    """GA's session object (`RealtimeSessionCreateResponse`); the client's tools,
    tool_choice, tracing, prompt, include, transcription and noise reduction echoed."""
    extra = config.extra_body
    tools = extra.get("realtime_tools")
    tool_choice = extra.get("realtime_tool_choice")
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": config.model,
        "output_modalities": output_modalities(config.modalities),
        "instructions": config.instructions or "",
        "audio": {
            "input": {
                "format": audio_format(config.input_audio_format),
                "transcription": _input_setting(
                    extra, "transcription", "input_audio_transcription"
                ),
                "noise_reduction": _input_setting(
                    extra, "noise_reduction", "input_audio_noise_reduction"
                ),
                "turn_detection": turn_detection(config.turn_detection),
            },
            "output": {
                "format": audio_format(config.output_audio_format),
                "voice": config.voice,
                "speed": 1.0 if config.speed is None else config.speed,
            },
        },
        "tools": tools if isinstance(tools, list) else [],
        "tool_choice": tool_choice if isinstance(tool_choice, str | dict) else "auto",
        "max_output_tokens": "inf" if config.max_tokens is None else config.max_tokens,
        "tracing": extra.get("realtime_tracing"),
        "truncation": "auto",
        "prompt": extra.get("realtime_prompt"),
        "include": extra.get("realtime_include"),
        "expires_at": None,  # no fixed lifetime: a session ends when idle (idle_timeout_s)
    }


def response_object(data: Mapping[str, Any], response: ActiveResponse | None, done: bool) -> JSON:
    """GA's response object from ours (`ActiveResponse.response_object`)."""
    status = data.get("status")
    details = data.get("status_details")
    reason = details.get("reason") if isinstance(details, Mapping) else None
    return {
        "object": "realtime.response",
        "id": data.get("id"),
        "status": status,
        "status_details": status_details(str(status), reason),
        "output": data.get("output") or [],
        "output_modalities": output_modalities(data.get("output_modalities")),
        "usage": copy.deepcopy(NO_USAGE) if done else None,
        "metadata": response.metadata if response is not None else None,
        "max_output_tokens": (
            "inf"
            if response is None or response.max_output_tokens is None
            else response.max_output_tokens
        ),
    }


# ---------------------------------------------------------------- request side


def client_command(command: DuplexCommand) -> DuplexCommand:
    """A client command as GA means it: a client's `input_audio_buffer.commit` never
    creates a response (only turn detection's commits do; `response.create` asks)."""
    if isinstance(command, Commit) and command.create_response is None:
        return dataclasses.replace(command, create_response=False)
    return command


def response_metadata(options: ResponseCreateOptions) -> dict[str, str] | None:
    """`response.create`'s `response.metadata` as GA takes it: null, or at most 16
    string keys (64 characters) to strings (512). Raises `invalid_session_config`."""
    metadata = options.extra_body.get("realtime_response_metadata")
    if metadata is None:
        return None
    ok = (
        isinstance(metadata, Mapping)
        and len(metadata) <= METADATA_MAX_KEYS
        and all(
            isinstance(k, str)
            and isinstance(v, str)
            and len(k) <= METADATA_MAX_KEY
            and len(v) <= METADATA_MAX_VALUE
            for k, v in metadata.items()
        )
    )
    if not ok:
        raise RealtimeProtocolError(
            "invalid_session_config",
            f"response.metadata must map at most {METADATA_MAX_KEYS} strings (keys up to "
            f"{METADATA_MAX_KEY} characters) to strings (up to {METADATA_MAX_VALUE})",
            param="response.metadata",
        )
    return dict(metadata)


# ---------------------------------------------------------------- the projection


def _find_response(session: EngineSession, response_id: Any) -> ActiveResponse | None:
    if not isinstance(response_id, str):
        return None
    found = session.responses.get(response_id)
    if found is None:
        for candidate in (session.active, session.last_response):
            if candidate is not None and candidate.response_id == response_id:
                return candidate
    return found


def _replace(original: Any, /, **changes: Any) -> DuplexEvent:
    """`original` with `changes`; a Tier 2 key it has renders no more when set to None
    (a field that is None is omitted on the wire)."""
    kept = {k: v for k, v in changes.items() if hasattr(original, k)}
    return dataclasses.replace(original, **kept)


def _session(event: Any, session: EngineSession) -> DuplexEvent:
    body = session_object(session.config, session.session_id)
    return _replace(event, session=body, attachment_generation=None, resume_token=None)


def _response(event: Any, session: EngineSession) -> DuplexEvent:
    found = _find_response(session, event.response.get("id"))
    done = event.wire_type == "response.done"
    return _replace(event, response=response_object(event.response, found, done), response_id=None)


def _audio_delta(event: Any, session: EngineSession) -> DuplexEvent:
    if all(getattr(event, key, None) is None for key in ("format", "sample_rate_hz", "metadata")):
        return event  # built GA's way already (response.audio_events with `ga`): nothing to drop
    return _replace(event, format=None, sample_rate_hz=None, metadata=None)


def _without_echo(event: Any, session: EngineSession) -> DuplexEvent:
    return _replace(event, event=None)  # committed, deleted, truncated: our `event` echo


def _transcribed(event: Any, session: EngineSession) -> DuplexEvent:
    if getattr(event, "usage", None) is not None:
        return event
    return _replace(event, usage=dict(NO_TRANSCRIPTION_USAGE))


_PROJECTIONS: dict[str, Callable[[Any, EngineSession], DuplexEvent]] = {
    "session.created": _session,
    "session.updated": _session,
    "response.created": _response,
    "response.done": _response,
    "response.output_audio.delta": _audio_delta,
    "input_audio_buffer.committed": _without_echo,
    "conversation.item.deleted": _without_echo,
    "conversation.item.truncated": _without_echo,
    "conversation.item.input_audio_transcription.completed": _transcribed,
}


def project(event: DuplexEvent, session: EngineSession) -> DuplexEvent | None:
    """`event` as the openai surface sends it, or None when it sends nothing for it."""
    wire_type = event.wire_type
    if SERVER_EVENT_TIERS.get(wire_type) == 3 or wire_type.startswith(RAW_EVENT_PREFIX):
        return None
    if wire_type in _SPEECH_TYPES and session.config.turn_detection is None:
        return None
    projection = _PROJECTIONS.get(wire_type)
    return event if projection is None else projection(event, session)
