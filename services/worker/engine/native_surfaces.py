"""The surfaces of native models' own clients: Moshi's protocol, OpenAI's GPT-Live and
OpenBMB's MAP Realtime V1.

A session opened on `/api/chat` (surface "moshi"), `/v1/live/sessions` ("live") or
`/v1/realtime` with the subprotocol `map.realtime` ("map") runs as any model-native session
(native_stream.py); only what it sends differs, as on the openai surface (surface.py).
`project` is called on every event its runner emits (`SessionBuilder._emitter`) and returns
what the journal gets instead, which the API pod turns into the protocol
(services/api/moshi_chat.py, services/api/live_sessions.py, services/api/map_realtime.py):

- **moshi**: the model's audio as its bytes (`MOSHI_AUDIO`, shared/protocol/duplex/moshi.py:
  the frame's pcm16, no base64, no JSON: the pod encodes it as Ogg Opus as it comes): a
  response's frames, and the frames the model stepped while it listened (the session is
  client-clocked, `client_clocked`: every frame it steps is sent, silence included), its
  words (the transcript and text deltas), errors, the closures, `session.created` (the
  pod's open needs it) and
  `session.started` (the model's prompt is stepped: the pod sends the `0x00` handshake).
  Everything else is dropped: the pod would send nothing for it, and it would cost a
  Redis write per event.
- **live**: GPT-Live's own events, built here, so that the journal holds what the client
  gets and the pod forwards them as they are: `session.started {session: {id}}`,
  `session.output_audio.delta {delta}`, `session.output_transcript.delta {delta,
  start_ms, end_ms}`, `session.input_audio.muted` / `unmuted`, `session.usage.updated
  {usage: {seconds}}`, `session.closed {reason, usage}` and `error {error: {type, code,
  message, param, client_event_id}}`. `session.created` passes (the pod's open reads it
  and sends nothing for it).
- **map**: MAP Realtime's own events (shared/protocol/duplex/map_realtime.py):
  `response.output_audio.delta {response_id, audio}` (the session's output format, which
  the pod opens as float32 at 24 kHz), `response.output.delta {response_id, kind: "text",
  text}` for the model's words, `response.done {response: {id, status, status_details?}}`,
  `error {error}` for an error the session does not outlive and `warning {warning}` for one
  it does (the SDK takes any `error` as the end), `session.closed {reason}`. The model's
  readiness is journaled as `session.started {session_id}`, which the pod sends as MAP's
  `session.created` (ours is the open's reply and never journaled). `session.created`
  passes, as for GPT-Live.

What GPT-Live keeps for a session is kept with the session (`NativeSurfaceState`,
in its checkpoint: it moves with it on a drain or a failover): whether `session.started`
was sent (a restored model's second "ready" sends nothing; MAP's readiness too), the mute
flag, and the usage last reported. The session's timeline is its input stream: usage
seconds are the input audio the session has taken (`InputLedger.stream_ms`, which the
checkpoint keeps), and a transcript delta's `start_ms` is where the input stream was when
the model said it, its `end_ms` one frame later.

The session's own signals to these surfaces are raw events (`DuplexRawEvent`, emitted only
for a native-surface session, never seen on the others): `model.ready`, `input.muted` and
`usage` (`ready_event`, `muted_event`, `usage_event`).
"""

from __future__ import annotations

import base64
import dataclasses
from typing import TYPE_CHECKING, Any

from shared.protocol.duplex import (
    MAP_READY,
    MOSHI_AUDIO,
    RAW_EVENT_PREFIX,
    SURFACE_LIVE,
    SURFACE_MAP,
    SURFACE_MOSHI,
    DuplexErrorEvent,
    DuplexEvent,
    DuplexRawEvent,
    live_closed,
    live_error_body,
    live_usage,
    map_closed,
    map_refusal,
)

if TYPE_CHECKING:
    from services.worker.engine.engine_session import EngineSession

JSON = dict[str, Any]

#: the raw events a native-surface session's runner emits for `project`
READY = "model.ready"
MUTED = "input.muted"
USAGE = "usage"
#: `session.usage.updated` is sent after every this much more input (GPT-Live reports its
#: usage cumulatively, as it goes; the last figure comes with `session.closed`)
USAGE_INTERVAL_MS = 5_000

#: a transcript piece spans one model frame (80 ms in the Moshi family: Mimi's 12.5 Hz)
TRANSCRIPT_SPAN_MS = 80
#: what the moshi surface's pod reads (anything else is dropped at the worker)
_MOSHI_PASSES = frozenset(
    {
        "session.created",
        "response.output_audio_transcript.delta",
        "response.output_text.delta",
        "error",
        "session.closed",
        "session.expired",
        "session.resync_required",
    }
)
_TRANSCRIPT_TYPES = frozenset(
    {"response.output_audio_transcript.delta", "response.output_text.delta"}
)


@dataclasses.dataclass(kw_only=True)
class SurfaceEvent(DuplexEvent):
    """An event in another protocol's own shape: its `type` and its body as they are sent.
    `response_id` is not sent: it goes in the live header (the pod drops a cancelled
    response's queued audio by it)."""

    TYPE = "<surface>"
    type_name: str
    body: JSON = dataclasses.field(default_factory=dict)
    response_id: str | None = None

    @property
    def wire_type(self) -> str:
        return self.type_name

    def wire_body(self) -> JSON:
        return self.body


@dataclasses.dataclass(kw_only=True)
class SurfaceBytes(DuplexEvent):
    """An event that crosses Redis as its bytes, not JSON (`payload`): a moshi session's
    audio. `to_dict` says what it is for a reader of the journal, not its bytes."""

    TYPE = "<surface bytes>"
    type_name: str
    data: bytes
    response_id: str | None = None

    @property
    def wire_type(self) -> str:
        return self.type_name

    def to_dict(self) -> JSON:
        return {"type": self.type_name, "bytes": len(self.data)}

    def payload(self) -> bytes:
        return self.data


# ---------------------------------------------------------------- the session's signals


def ready_event() -> DuplexRawEvent:
    """The model has stepped the slot's prompt (or rebuilt it from its history)."""
    return DuplexRawEvent(internal_type=READY)


def muted_event(muted: bool, event_id: str | None) -> DuplexRawEvent:
    return DuplexRawEvent(internal_type=MUTED, event={"muted": muted, "event_id": event_id})


def usage_event(stream_ms: int) -> DuplexRawEvent:
    return DuplexRawEvent(internal_type=USAGE, event={"ms": stream_ms})


def client_clocked(session: EngineSession) -> bool:
    """Whether the session's input is its model's clock (`StagePlan.client_clock`).

    Moshi's protocol: its reference server (kyutai's `moshi.server`) steps the model once
    per 1920 samples of the client's audio and sends each step's audio back, silence
    included, so its clients (LiveKit's PersonaPlex plugin, Moshi's web client) get a frame
    for every frame they send, and a client that stops sending stops the model. The other
    surfaces keep the server's clock: their clients are Realtime API clients, which send
    audio in chunks of their own size and pace and expect the server to keep real time
    (input that has not arrived is silence to the model)."""
    return session.config.surface == SURFACE_MOSHI


def usage_due(session: EngineSession) -> bool:
    """Whether `session.usage.updated` is due (GPT-Live's surface only)."""
    state = session.surface_state
    return (
        session.config.surface == SURFACE_LIVE
        and session.input.stream_ms - state.usage_reported_ms >= USAGE_INTERVAL_MS
    )


# ---------------------------------------------------------------- projection


def project(event: DuplexEvent, session: EngineSession) -> DuplexEvent | None:
    """`event` as a native surface's journal holds it, or None when it holds nothing."""
    wire_type = event.wire_type
    raw = event.internal_type if isinstance(event, DuplexRawEvent) else None
    surface = session.config.surface
    if raw == READY:
        if session.surface_state.started:
            return None  # a restored slot is ready again: the client was told once
        session.surface_state.started = True
        if surface == SURFACE_MAP:
            return SurfaceEvent(type_name=MAP_READY, body={"session_id": session.session_id})
        body = {"session": {"id": session.session_id}}
        return SurfaceEvent(type_name="session.started", body=body)
    if wire_type in _TRANSCRIPT_TYPES and not event.delta:  # type: ignore[attr-defined]
        return None  # a frame without words (the response's audio goes on)
    if surface == SURFACE_MAP:
        if raw is not None or wire_type.startswith(RAW_EVENT_PREFIX):
            return None  # GPT-Live's mute and usage: not MAP's
        return _map(event, wire_type)
    if surface == SURFACE_MOSHI:
        if isinstance(event, SurfaceBytes):  # a quiet frame of the client's clock
            return event
        if wire_type == "response.output_audio.delta":
            return SurfaceBytes(
                type_name=MOSHI_AUDIO,
                data=base64.b64decode(event.delta),  # type: ignore[attr-defined]
                response_id=getattr(event, "response_id", None),
            )
        return event if wire_type in _MOSHI_PASSES else None
    if raw is not None:
        return _live_signal(raw, event.event, session)  # type: ignore[union-attr]
    if wire_type.startswith(RAW_EVENT_PREFIX):
        return None
    return _live(event, wire_type, session)


def _live_signal(raw: str, body: JSON, session: EngineSession) -> DuplexEvent | None:
    if raw == MUTED:
        kind = "session.input_audio.muted" if body.get("muted") else "session.input_audio.unmuted"
        event_id = body.get("event_id")
        return SurfaceEvent(type_name=kind, body={"client_event_id": event_id} if event_id else {})
    if raw == USAGE:
        ms = int(body.get("ms", 0))
        session.surface_state.usage_reported_ms = ms
        return SurfaceEvent(type_name="session.usage.updated", body={"usage": live_usage(ms)})
    return None


def _live(event: DuplexEvent, wire_type: str, session: EngineSession) -> DuplexEvent | None:
    if wire_type == "session.created":
        return event
    if wire_type == "response.output_audio.delta":
        return SurfaceEvent(
            type_name="session.output_audio.delta",
            body={"delta": event.delta},  # type: ignore[attr-defined]
            response_id=getattr(event, "response_id", None),
        )
    if wire_type in _TRANSCRIPT_TYPES:
        start = session.input.stream_ms
        return SurfaceEvent(
            type_name="session.output_transcript.delta",
            body={
                "delta": event.delta,  # type: ignore[attr-defined]
                "start_ms": start,
                "end_ms": start + TRANSCRIPT_SPAN_MS,
            },
            response_id=getattr(event, "response_id", None),
        )
    if wire_type == "error" and isinstance(event, DuplexErrorEvent):
        return SurfaceEvent(type_name="error", body={"error": live_error_body(event.error_body())})
    if wire_type == "session.closed":
        reason = event.reason  # type: ignore[attr-defined]
        return SurfaceEvent(
            type_name="session.closed",
            body=live_closed(reason, session.input.stream_ms),
        )
    if wire_type == "session.expired":
        # the close that follows says it (its reason, "timeout", is GPT-Live's "expired"):
        # a `session.closed` here would end the session's journal and checkpoint early
        return None
    if wire_type == "session.resync_required":
        return event  # the pod ends the socket on it (its journal is gone)
    return None


def _map(event: DuplexEvent, wire_type: str) -> DuplexEvent | None:
    """A map session's event as MAP Realtime V1 has it (module docstring)."""
    response_id = getattr(event, "response_id", None)
    if wire_type == "session.created":
        return event  # the pod's open reads it; MAP's session.created is the ready signal
    if wire_type == "response.output_audio.delta":
        return SurfaceEvent(
            type_name="response.output_audio.delta",
            body={"response_id": response_id, "audio": event.delta},  # type: ignore[attr-defined]
            response_id=response_id,
        )
    if wire_type in _TRANSCRIPT_TYPES:
        return SurfaceEvent(
            type_name="response.output.delta",
            body={"response_id": response_id, "kind": "text", "text": event.delta},  # type: ignore[attr-defined]
            response_id=response_id,
        )
    if wire_type == "response.done":
        response = event.response  # type: ignore[attr-defined]
        done = {key: response[key] for key in ("id", "status") if key in response}
        if response.get("status_details"):
            done["status_details"] = response["status_details"]
        return SurfaceEvent(
            type_name="response.done", body={"response": done}, response_id=done.get("id")
        )
    if wire_type == "error" and isinstance(event, DuplexErrorEvent):
        refusal = map_refusal(event.error_body())
        kind = refusal.pop("type")
        return SurfaceEvent(type_name=kind, body=refusal)
    if wire_type == "session.closed":
        return SurfaceEvent(
            type_name="session.closed",
            body=map_closed(event.reason),  # type: ignore[attr-defined]
        )
    if wire_type == "session.resync_required":
        return event  # the pod ends the socket on it (its journal is gone)
    # session.expired: the close that follows says it; a response's other events (created,
    # items, parts, speak, done audio): MAP has none
    return None
