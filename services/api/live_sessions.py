"""`/v1/live/sessions`: OpenAI's GPT-Live protocol, for native (frame-clocked) models.

GPT-Live is OpenAI's full-duplex voice API: the model takes the turns (no commit, no
`response.create`), the client streams its microphone and plays what comes back. Its
clients (LiveKit's `GPTLiveModel`, Pipecat's `OpenAILiveLLMService`) reach our native
models here unchanged, with their base URL pointed at us. JSON text frames both ways:

- the client opens with `session.start {session: {model, instructions, audio: {format:
  {type, rate}, output: {voice}}, input, delegation}}` and waits for `session.started
  {session: {id}}`, which comes once the model has opened its slot and stepped its prompt;
- `session.input_audio.append {audio}` (base64, 100 ms at a time from LiveKit),
  `session.input_audio.mute` / `unmute` (the model hears silence, and goes on speaking;
  answered `session.input_audio.muted` / `unmuted` once applied in order with the audio),
  `session.update` (delegation settings: answered `session.updated`, nothing changes),
  `session.close` (answered `session.closed {reason, usage}`, then the socket closes);
- the server sends `session.output_audio.delta {delta}`, `session.output_transcript.delta
  {delta, start_ms, end_ms}`, `session.usage.updated {usage: {seconds}}` and `error`.

These events are built on the worker (services/worker/engine/native_surfaces.py), where
the mute flag, the usage and the timeline live with the session and move with it; this
socket forwards them as they are. What it answers itself: `session.updated` (delegation is
accepted and ignored: there is no delegation backend here), and refusals, as `error` events
that end nothing: `session.instructions.append`, `session.thinking.append` and
`session.commentary.append` (`native_text_append_unsupported`: a native model hears audio,
not text), `response.item.create` and `response.create`
(`unsupported_native_response_options`), a second `session.start` (`session_exists`),
anything else (`unknown_event`, `invalid_json`, `bad_audio`).

`session.start` is mapped to the session: `model`, `instructions` (PersonaPlex's persona),
`audio.format` (audio/pcm at its rate, default 24 kHz; audio/pcmu, audio/pcma: G.711 at
8 kHz) for input and output alike. The voice (GPT-Live's names), the startup `input` items
and `delegation` are accepted and ignored (docs/wire-api.md). A session.start that cannot
open a session is answered with its `error`, and the socket closes.

The key is the `Authorization: Bearer` header (or `?api_key=`), refused with HTTP 401
before the upgrade. A dropped socket ends the session (GPT-Live has no resume).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from typing import Any

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.api.attachment import AttachFailed
from services.api.delivery import SessionParts
from services.api.door import Door
from services.api.metrics import ApiMetrics
from services.api.output_queue import CLOSURE_TYPES, OutItem
from services.api.socket_driver import (
    Close,
    Message,
    PartsFactory,
    SocketDriver,
    SocketEndpoint,
    refusal,
)
from shared.protocol.duplex import (
    G711_ALAW,
    G711_ULAW,
    PCM16,
    SURFACE_KEY,
    SURFACE_LIVE,
    AppendAudio,
    CloseSession,
    DuplexErrorEvent,
    MuteInput,
    live_closed,
    live_error_body,
)

log = logging.getLogger(__name__)

#: GPT-Live's audio formats -> ours (G.711 is 8 kHz)
FORMATS = {"audio/pcm": PCM16, "audio/pcmu": G711_ULAW, "audio/pcma": G711_ALAW}
DEFAULT_RATE = 24_000
#: the context appends a native model cannot take (it hears audio, not text)
TEXT_APPENDS = frozenset(
    {"session.instructions.append", "session.thinking.append", "session.commentary.append"}
)
#: delegated work (a backend Responses model): none here
DELEGATION_EVENTS = frozenset({"response.item.create", "response.create"})
ENDINGS = CLOSURE_TYPES | {"session.resync_required"}
#: client messages kept while the model gets ready (the clients send none: a bound, not a
#: buffer)
MAX_EARLY_EVENTS = 64


class StartRefused(Exception):
    """A session.start that does not describe a session we can open."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


#: the route
LIVE_SESSIONS_PATH = "/v1/live/sessions"


class LiveSessionsEndpoint(SocketEndpoint):
    """The door of `/v1/live/sessions`: the key, then the upgrade and the connection."""

    def __init__(
        self,
        door: Door,
        metrics: ApiMetrics,
        parts: PartsFactory,
        *,
        config_timeout_s: float,
        ready_timeout_s: float,
        max_input_bytes: int,
    ) -> None:
        self.door = door
        self.ready_timeout_s = ready_timeout_s
        self.metrics = metrics
        self.parts = parts
        self.config_timeout_s = config_timeout_s
        self.max_input_bytes = max_input_bytes

    def match(self, path: str) -> tuple[()] | None:
        return () if path == LIVE_SESSIONS_PATH else None

    async def __call__(self, websocket: WebSocket) -> None:  # type: ignore[override]
        admitted = await self.door.admit(websocket)
        if admitted is None:
            return
        await websocket.accept()
        self.metrics.active_sessions.inc()
        try:
            connection = LiveConnection(
                websocket,
                self.parts(admitted.key),
                self.metrics,
                self.max_input_bytes,
                config_timeout_s=self.config_timeout_s,
                ready_timeout_s=self.ready_timeout_s,
            )
            await connection.run()
        finally:
            self.metrics.active_sessions.dec()


def session_from_start(start: Any) -> tuple[dict[str, Any], str, int]:
    """The opening session object of a `session.start`'s `session`, and its audio format."""
    if not isinstance(start, dict):
        raise StartRefused("invalid_session_config", "session must be an object", "session")
    model = start.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise StartRefused("invalid_session_config", "session.model must be a string", "model")
    instructions = start.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise StartRefused(
            "invalid_session_config", "session.instructions must be a string", "instructions"
        )
    audio = start.get("audio") or {}
    audio_format = audio.get("format") if isinstance(audio, dict) else None
    audio_format = audio_format or {}
    if not isinstance(audio_format, dict):
        raise StartRefused("invalid_session_config", "audio.format must be an object", "audio")
    kind = audio_format.get("type", "audio/pcm")
    encoding = FORMATS.get(kind) if isinstance(kind, str) else None
    if encoding is None:
        raise StartRefused(
            "unsupported_audio_format",
            f"audio.format.type {kind!r}: one of {', '.join(FORMATS)}",
            "audio.format.type",
        )
    rate = audio_format.get("rate", DEFAULT_RATE) if encoding == PCM16 else 8000
    if not isinstance(rate, int) or isinstance(rate, bool) or not 8000 <= rate <= 48_000:
        raise StartRefused(
            "unsupported_audio_format",
            "audio.format.rate must be an integer from 8000 to 48000",
            "audio.format.rate",
        )
    ga_format = {"type": "audio/pcm", "rate": rate} if encoding == PCM16 else {"type": kind}
    session: dict[str, Any] = {
        SURFACE_KEY: SURFACE_LIVE,
        "audio": {"input": {"format": ga_format}, "output": {"format": ga_format}},
    }
    if model:
        session["model"] = model
    if instructions:
        session["instructions"] = instructions
    return session, encoding, rate


def live_error(
    code: str, message: str, *, client_event_id: str | None = None, param: str | None = None
) -> dict[str, Any]:
    error = DuplexErrorEvent.for_code(code, message, param=param, related_event_id=client_event_id)
    return {"type": "error", "error": live_error_body(error.error_body())}


class LiveConnection(SocketDriver):
    """One `/v1/live/sessions` socket and its session."""

    protocol = "live"
    #: what the client sent before session.started is handled after it (the clients send
    #: nothing then: a bound, not a buffer)
    max_early = MAX_EARLY_EVENTS

    def __init__(
        self,
        websocket: WebSocket,
        parts: SessionParts,
        metrics: ApiMetrics,
        max_input_bytes: int,
        *,
        config_timeout_s: float,
        ready_timeout_s: float,
    ) -> None:
        super().__init__(websocket, parts.attachment, parts.delivery, metrics)
        self.attachment.serve_surface(SURFACE_LIVE)  # no resume: the socket is the session
        self.max_input_bytes = max_input_bytes
        self.config_timeout_s = config_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.encoding, self.rate = PCM16, DEFAULT_RATE
        self.closing = False  # session.close sent: the writer closes after session.closed
        self.started = asyncio.Event()  # session.started went out

    # ------------------------------------------------------------ the driver's hooks

    async def open(self, writer: asyncio.Task[None]) -> bool:
        return await self._start(self.config_timeout_s)

    async def ready(self, writer: asyncio.Task[None]) -> bool | Close:
        """Until session.started went out (True), the session ended or the client left
        first, or the model took longer than its timeout to step its prompt (told, False).
        GPT-Live's clients send nothing before session.started; what one sends anyway is
        handled after it (`early`)."""
        outcome = await self.wait_ready(self.started, writer, self.ready_timeout_s)
        if outcome == "timeout":
            log.warning(
                "session %s: the model did not get ready in time", self.attachment.session_id
            )
            self._say(live_error("timeout", "the model did not get ready in time"))
        return outcome == "ready"

    async def on_message(self, message: Message) -> Close | None:
        event = self._event(message)
        if event is not None and self.attachment.live:
            await self._handle(event)
        return None

    def refuse(self, event: DuplexErrorEvent) -> None:
        self._say({"type": "error", "error": live_error_body(event.error_body())})

    def failed(self) -> Close | None:
        self._say(live_error("internal_error", "the server failed on this connection"))
        return None

    # ------------------------------------------------------------ session.start

    async def _start(self, timeout_s: float) -> bool:
        """Until a session.start opens the session (True), or the client gives up or is
        refused (False: it was told why). The timeout is the wait for session.start; the
        open itself has the attachment's."""
        deadline = time.monotonic() + timeout_s
        while True:
            message = await self.receive(timeout=max(0.0, deadline - time.monotonic()))
            if message is None:
                self._say(
                    live_error("config_timeout", "no session.start within the config timeout")
                )
                return False
            event = self._event(message)
            if event is None:
                continue
            if event["type"] != "session.start":
                self._refuse_before_start(event)
                continue
            return await self._open(event)

    def _refuse_before_start(self, event: dict[str, Any]) -> None:
        self._say(
            live_error(
                "invalid_session_config",
                "the first event must be session.start",
                client_event_id=_event_id(event),
            )
        )

    async def _open(self, event: dict[str, Any]) -> bool:
        try:
            session, self.encoding, self.rate = session_from_start(event.get("session"))
        except StartRefused as refused:
            self._say(
                live_error(
                    refused.code,
                    refused.message,
                    client_event_id=_event_id(event),
                    param=refused.param,
                )
            )
            return False
        try:
            reply = await self.attachment.open(session, None)
        except AttachFailed as failed:
            code, message, param = refusal(failed)
            self._say(live_error(code, message, client_event_id=_event_id(event), param=param))
            return False
        self.delivery.created(reply)  # not sent: session.started comes when the model is ready
        self.metrics.sessions_opened.inc()
        return True

    # ------------------------------------------------------------ client -> session

    def _event(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """A client message as an event, or None after answering one that is not."""
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        text = message.get("text")
        if text is None:
            self._say(live_error("bad_event", "send JSON text frames"))
            return None
        try:
            event = orjson.loads(text)
        except orjson.JSONDecodeError:
            self._say(live_error("invalid_json", "the frame is not JSON"))
            return None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            self._say(live_error("bad_event", "an event is an object with a string type"))
            return None
        return event

    async def _handle(self, event: dict[str, Any]) -> None:
        kind, event_id = event["type"], _event_id(event)
        if kind == "session.input_audio.append":
            audio = self._audio(event)
            if audio is not None:
                await self.command(
                    AppendAudio(audio=audio, format=self.encoding, sample_rate_hz=self.rate), None
                )
        elif kind in ("session.input_audio.mute", "session.input_audio.unmute"):
            muted = kind == "session.input_audio.mute"
            await self.command(MuteInput(event_id=event_id, muted=muted), event_id)
        elif kind == "session.update":
            self._say(
                {
                    "type": "session.updated",
                    "session": {"id": self.attachment.session_id},
                    **({"client_event_id": event_id} if event_id else {}),
                }
            )
        elif kind == "session.close":
            self.closing = True
            await self.command(CloseSession(event_id=event_id, reason="client_close"), event_id)
        elif kind in TEXT_APPENDS:
            self._say(
                live_error(
                    "native_text_append_unsupported",
                    f"{kind} is not taken: this model hears the conversation's audio, not "
                    "text appended to it",
                    client_event_id=event_id,
                )
            )
        elif kind in DELEGATION_EVENTS:
            self._say(
                live_error(
                    "unsupported_native_response_options",
                    f"{kind}: there is no delegation backend here; the model decides itself "
                    "when and what it speaks",
                    client_event_id=event_id,
                )
            )
        elif kind == "session.start":
            self._say(
                live_error("session_exists", "the session is started", client_event_id=event_id)
            )
        else:
            self._say(
                live_error(
                    "unknown_event",
                    f"unknown client event type {kind[:80]!r}",
                    client_event_id=event_id,
                    param="type",
                )
            )

    def _audio(self, event: dict[str, Any]) -> bytes | None:
        data = event.get("audio")
        try:
            if not isinstance(data, str):
                raise ValueError("audio must be a base64 string")
            audio = base64.b64decode(data, validate=True)
            if self.encoding == PCM16 and len(audio) % 2:
                raise ValueError("pcm16 audio must be a whole number of 2-byte samples")
        except (binascii.Error, ValueError) as exc:
            self._say(live_error("bad_audio", str(exc), client_event_id=_event_id(event)))
            return None
        if len(audio) > self.max_input_bytes:
            self._say(
                live_error(
                    "input_backpressure",
                    f"an append of {len(audio)} bytes is over the session's pending input "
                    f"limit of {self.max_input_bytes} bytes; send smaller appends",
                    client_event_id=_event_id(event),
                )
            )
            return None
        return audio

    # ------------------------------------------------------------ session -> client

    def _say(self, body: dict[str, Any]) -> None:
        """One event of this socket's own, queued behind the session's."""
        if body["type"] == "error":
            code = body["error"].get("code")
            self.metrics.errors.labels(code or "unknown").inc()
        self.delivery.queue.put(OutItem(orjson.dumps(body), body["type"]))

    async def send_item(self, item: OutItem) -> bool:
        wire_type = item.wire_type
        if wire_type == "session.created":
            self.attachment.created_delivered()  # ours: GPT-Live has session.started
        elif wire_type == "session.started":
            await self.ws.send_text(item.data.decode())
            self.started.set()
        elif wire_type == "error":
            await self.ws.send_text(_live_error_json(item.data))
        elif wire_type in ENDINGS:
            await self.ws.send_text(_live_closed_json(item.data, wire_type))
            await self.ws.close(1000)
            return False
        else:
            await self.ws.send_text(item.data.decode())
        return True


def _event_id(event: dict[str, Any]) -> str | None:
    value = event.get("event_id")
    return value if isinstance(value, str) else None


def _live_error_json(data: bytes) -> str:
    """An error as GPT-Live has it: the pod's own (duplex-shaped: `error.event_id`, a
    `retryable` flag) rewritten, the worker's projected ones as they are."""
    event = orjson.loads(data)
    error = event.get("error") if isinstance(event, dict) else None
    if isinstance(error, dict) and ("event_id" in error or "retryable" in error):
        return orjson.dumps({"type": "error", "error": live_error_body(error)}).decode()
    return data.decode()


def _live_closed_json(data: bytes, wire_type: str) -> str:
    """`session.closed` as GPT-Live has it. The worker's projection already is; a closure
    published for the session without its worker (the janitor's, after a worker was lost
    and no other could take the session; a resync) is rewritten, its usage unknown here."""
    event = orjson.loads(data)
    if wire_type == "session.closed" and isinstance(event, dict) and "usage" in event:
        return data.decode()
    reason = event.get("reason") if isinstance(event, dict) else None
    return orjson.dumps({"type": "session.closed", **live_closed(reason, 0)}).decode()
