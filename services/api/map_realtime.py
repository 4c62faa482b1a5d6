"""`/v1/realtime` with the subprotocol `map.realtime`: OpenBMB's MAP Realtime V1, for native
(frame-clocked) models.

MAP Realtime V1 is the protocol of OpenBMB's realtime SDK for MiniCPM-o (`openbmb-realtime`,
`RealtimeClient(...).audio.connect(model=...)` / `.video.connect`). It shares its path with
OpenAI's Realtime route; the subprotocol tells them apart (`SocketEndpoint.subprotocol`).
JSON text frames both ways:

- the client connects to `/v1/realtime?mode=audio|video&model=<name>` with `Authorization:
  Bearer <key>` and the subprotocol `map.realtime`, and sends nothing until the server says
  `session.queue_done`: while no worker of the model has a free slot the server says
  `session.queued` (then `session.queue_update` every `QUEUE_UPDATE_S`), for up to the
  admission wait (`DUPLEX_ADMISSION_WAIT_S`);
- the client then sends `session.init {payload: {system_prompt?, config?: {temperature,
  max_tokens, length_penalty, max_kv_tokens, tts_enabled, vision_hd}, voice?:
  {ref_audio_base64?, tts_ref_audio_base64?}, max_slice_nums?}}` (`session_from_init` maps it
  to the session object), the session opens on a worker, and once the model has stepped its
  prompt the server sends `session.created {session_id}`;
- `input.append {input: {audio, force_listen?, video_frames?}}`: base64 float32 mono 16 kHz
  audio, a forced listen (the SDK's `interrupt()`: the model's speech is cut, `BargeIn`, and
  the append carries `force_listen` to the model as the duplex surface's does), and in a
  video session base64 JPEG camera frames, carried with the audio as the duplex surface's
  `video_frames`;
- `session.close {reason}`: answered `session.closed {reason}`, then the socket closes.

The server's events are built on the worker (services/worker/engine/native_surfaces.py:
`response.output_audio.delta {audio}` float32 24 kHz, `response.output.delta {kind: "text",
text}`, `response.done`, `session.closed`, errors), so the journal holds what the client
gets; this socket forwards them, renaming one: the model's readiness, journaled as
`session.started`, is MAP's `session.created` (ours is the open's reply).

The SDK ends the session on any `error` event, so `error` is sent only when the session
ends (the refusals that close the socket here, and the errors the session is closed on);
a refusal the session outlives is a `warning` with the same body, which the SDK ignores
(shared/protocol/duplex/map_realtime.py). The protocol has no resume: a dropped socket ends
the session.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
from starlette.datastructures import QueryParams
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.api.attachment import NATIVE_CAPABILITY, AttachFailed
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
from shared.backoff import Backoff
from shared.protocol.duplex import (
    MAP_INPUT_RATE_HZ,
    MAP_MODES,
    MAP_OUTPUT_RATE_HZ,
    MAP_READY,
    MAP_SUBPROTOCOL,
    MAP_WARNING,
    PCM_F32LE,
    SURFACE_KEY,
    SURFACE_MAP,
    AppendAudio,
    BargeIn,
    CloseSession,
    DuplexErrorEvent,
    RealtimeProtocolError,
    encode_wav,
    error_type_for,
    f32le_to_float,
    map_closed,
    map_refusal,
)
from shared.redis.placement import WorkerDirectory

log = logging.getLogger(__name__)

#: the capability of a model that takes camera frames (a mode=video session needs one)
IMAGE_CAPABILITY = "supports_image_input"
#: the route (shared with OpenAI's Realtime; the subprotocol says which)
MAP_PATH = "/v1/realtime"
#: while the session waits for a slot, a `session.queue_update` this often (OpenBMB's
#: gateway's pace)
QUEUE_UPDATE_S = 3.0
#: what ends the socket: the closures, and a journal gone (nothing can continue)
ENDINGS = CLOSURE_TYPES | {"session.resync_required"}
#: the queue's type of an `error` this socket says itself before it closes (the open
#: refused, the model never ready): sent as it is, whatever its code (the session's errors
#: are said as `error` only when their code ends it: `_map_error_json`)
FINAL_ERROR = "map.final_error"
#: frames longer than this are parsed off the event loop (a 100 ms append is about 8 KiB)
PARSE_INLINE_MAX_CHARS = 256 * 1024
#: client messages kept while the model gets ready (the SDK sends none before
#: session.created: a bound, not a buffer)
MAX_EARLY_EVENTS = 64
#: a voice reference longer than this is refused: it rides in the session object (the
#: session's record and every checkpoint carry it), and a voice prompt is a few seconds
MAX_REF_AUDIO_S = 20
#: `session.init`'s payload and its config, as the SDK builds them (`build_session_init`)
INIT_KEYS = frozenset({"system_prompt", "config", "voice", "max_slice_nums"})
CONFIG_KEYS = frozenset(
    {"temperature", "max_tokens", "length_penalty", "max_kv_tokens", "tts_enabled", "vision_hd"}
)
VOICE_KEYS = frozenset({"ref_audio_base64", "tts_ref_audio_base64"})
#: the session's audio both ways (the worker converts to and from the model's rates)
INPUT_FORMAT = {"type": "audio/pcm_f32le", "rate": MAP_INPUT_RATE_HZ}
OUTPUT_FORMAT = {"type": "audio/pcm_f32le", "rate": MAP_OUTPUT_RATE_HZ}


class InitRefused(Exception):
    """A `session.init` (or the route's query) that does not describe a session we open."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


class MapRealtimeEndpoint(SocketEndpoint):
    """The door of `/v1/realtime` for a socket that offers `map.realtime`: the key, then the
    upgrade and the connection."""

    subprotocol = MAP_SUBPROTOCOL

    def __init__(
        self,
        door: Door,
        metrics: ApiMetrics,
        parts: PartsFactory,
        directory: WorkerDirectory,
        *,
        admission_wait_s: float,
        config_timeout_s: float,
        ready_timeout_s: float,
        max_input_bytes: int,
    ) -> None:
        self.door = door
        self.metrics = metrics
        self.parts = parts
        self.directory = directory
        self.admission_wait_s = admission_wait_s
        self.config_timeout_s = config_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.max_input_bytes = max_input_bytes

    def match(self, path: str) -> tuple[()] | None:
        return () if path == MAP_PATH else None

    async def __call__(self, websocket: WebSocket) -> None:  # type: ignore[override]
        admitted = await self.door.admit(websocket)
        if admitted is None:
            return
        await websocket.accept(subprotocol=MAP_SUBPROTOCOL)
        self.metrics.active_sessions.inc()
        try:
            connection = MapConnection(
                websocket,
                self.parts(admitted.key),
                self.metrics,
                self.directory,
                admitted.query,
                admission_wait_s=self.admission_wait_s,
                config_timeout_s=self.config_timeout_s,
                ready_timeout_s=self.ready_timeout_s,
                max_input_bytes=self.max_input_bytes,
            )
            await connection.run()
        finally:
            self.metrics.active_sessions.dec()


# ---------------------------------------------------------------- session.init -> session


def mode_from_query(query: QueryParams) -> str:
    """The session's mode (`audio` when the query names none)."""
    mode = query.get("mode") or "audio"
    if mode not in MAP_MODES:
        raise InitRefused(
            "invalid_session_config", f"mode must be one of {', '.join(MAP_MODES)}", "mode"
        )
    return mode


def session_from_init(event: Mapping[str, Any], model: str | None) -> dict[str, Any]:
    """The opening session object of a `session.init` (docs/wire-api.md, MAP Realtime V1)."""
    payload = event.get("payload")
    payload = {} if payload is None else payload
    if not isinstance(payload, Mapping):
        raise InitRefused("invalid_session_config", "payload must be an object", "payload")
    _known(payload, INIT_KEYS, "payload")
    session: dict[str, Any] = {
        SURFACE_KEY: SURFACE_MAP,
        "audio": {"input": {"format": INPUT_FORMAT}, "output": {"format": OUTPUT_FORMAT}},
    }
    extra: dict[str, Any] = {}
    if model:
        session["model"] = model
    prompt = payload.get("system_prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InitRefused(
            "invalid_session_config", "system_prompt must be a string", "payload.system_prompt"
        )
    if prompt:
        session["instructions"] = prompt
    config = payload.get("config")
    config = {} if config is None else config
    if not isinstance(config, Mapping):
        raise InitRefused("invalid_session_config", "config must be an object", "payload.config")
    _known(config, CONFIG_KEYS, "payload.config")
    if (temperature := config.get("temperature")) is not None:
        session["temperature"] = _number(temperature, "temperature", 0.0, 2.0)
    if (max_tokens := config.get("max_tokens")) is not None:
        extra["max_new_speak_tokens_per_chunk"] = _count(max_tokens, "config.max_tokens")
    if (penalty := config.get("length_penalty")) is not None:
        extra["length_penalty"] = _number(penalty, "length_penalty", 0.1, 5.0)
    if (kv := config.get("max_kv_tokens")) is not None:
        extra["max_kv_tokens"] = _count(kv, "config.max_kv_tokens")
    tts = config.get("tts_enabled")
    if tts is not None and not _flag(tts, "tts_enabled"):
        session["modalities"] = ["text"]  # the model's words alone, no audio
    if (hd := config.get("vision_hd")) is not None:
        extra["vision_hd"] = _flag(hd, "vision_hd")
    if (slices := payload.get("max_slice_nums")) is not None:
        extra["max_slice_nums"] = _count(slices, "max_slice_nums", prefix="payload")
    voice = payload.get("voice")
    voice = {} if voice is None else voice
    if not isinstance(voice, Mapping):
        raise InitRefused("invalid_session_config", "voice must be an object", "payload.voice")
    _known(voice, VOICE_KEYS, "payload.voice")
    if ref := voice.get("ref_audio_base64"):
        session["ref_audio"] = _reference_audio(ref, "ref_audio_base64")
    if tts_ref := voice.get("tts_ref_audio_base64"):
        extra["tts_ref_audio"] = _reference_audio(tts_ref, "tts_ref_audio_base64")
    if extra:
        session["extra_body"] = extra
    return session


def _known(values: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    unknown = sorted(set(values) - known)
    if unknown:
        raise InitRefused(
            "invalid_session_config",
            f"{where} has keys this server does not take: {unknown[:5]}; it takes {sorted(known)}",
            f"{where}.{unknown[0]}",
        )


def _number(value: Any, name: str, low: float, high: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise InitRefused(
            "invalid_session_config",
            f"{name} must be a number from {low} to {high}",
            f"payload.config.{name}",
        )
    return float(value)


def _count(value: Any, name: str, prefix: str = "payload") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InitRefused(
            "invalid_session_config", f"{name} must be a positive integer", f"{prefix}.{name}"
        )
    return value


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InitRefused(
            "invalid_session_config", f"{name} must be a boolean", f"payload.config.{name}"
        )
    return value


def _reference_audio(value: Any, name: str) -> str:
    """A voice reference (base64 float32 mono 16 kHz, as OpenBMB's servers take it) as the
    session's `ref_audio`: a WAV data URL, the form the duplex surface takes."""
    param = f"payload.voice.{name}"
    try:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a base64 string")
        samples = f32le_to_float(base64.b64decode(value, validate=True))
    except (binascii.Error, ValueError, RealtimeProtocolError) as exc:
        message = exc.message if isinstance(exc, RealtimeProtocolError) else str(exc)
        raise InitRefused("bad_audio", f"{name}: {message}", param) from None
    if samples.size > MAX_REF_AUDIO_S * MAP_INPUT_RATE_HZ:
        raise InitRefused("bad_audio", f"{name} is over {MAX_REF_AUDIO_S} s of 16 kHz audio", param)
    wav = encode_wav(np.clip(samples, -1.0, 1.0), MAP_INPUT_RATE_HZ)
    return "data:audio/wav;base64," + base64.b64encode(wav).decode()


# ---------------------------------------------------------------- client frames


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a client frame (or its append) is not taken: a `warning` the session outlives."""

    code: str
    message: str
    param: str | None = None


@dataclasses.dataclass(frozen=True)
class Frame:
    """A client frame: its event, and for an `input.append` the append it is (or why not)."""

    event: dict[str, Any]
    append: AppendAudio | Refusal | None = None


def parse_frame(text: str | None, mode: str, max_input_bytes: int) -> Frame | Refusal:
    """A client's text frame (None: a binary one) as an event, and an `input.append`'s as
    the duplex surface's append. Pure, so that a large frame is parsed on a thread."""
    if text is None:
        return Refusal("bad_event", "send JSON text frames")
    try:
        event = orjson.loads(text)
    except orjson.JSONDecodeError:
        return Refusal("invalid_json", "the frame is not JSON")
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        return Refusal("bad_event", "an event is an object with a string type")
    if event["type"] != "input.append":
        return Frame(event)
    return Frame(event, parse_append(event.get("input"), mode, max_input_bytes))


def parse_append(data: Any, mode: str, max_input_bytes: int) -> AppendAudio | Refusal:
    """An `input.append`'s `input` as the duplex surface's append: float32 16 kHz audio,
    `force_listen` as the hint the append carries to the model, `video_frames` as they are
    (mode=video only)."""
    if not isinstance(data, dict):
        return Refusal("bad_event", "input must be an object", "input")
    audio = data.get("audio")
    if not audio:
        return Refusal("bad_audio", "input.audio is required: base64 float32 16 kHz", "input.audio")
    frames = data.get("video_frames")
    if frames and mode != "video":
        return Refusal(
            "invalid_video_frames",
            "video_frames in a mode=audio session: connect with mode=video",
            "input.video_frames",
        )
    force_listen = data.get("force_listen", False)
    if not isinstance(force_listen, bool):
        return Refusal("bad_event", "force_listen must be a boolean", "input.force_listen")
    wire: dict[str, Any] = {
        "audio": audio,
        "format": PCM_F32LE,
        "sample_rate_hz": MAP_INPUT_RATE_HZ,
    }
    if frames is not None:
        wire["video_frames"] = frames
    if force_listen:
        wire["force_listen"] = True
    try:
        append = AppendAudio.from_wire(wire)
    except RealtimeProtocolError as exc:
        return Refusal(exc.code, exc.message, f"input.{exc.param}" if exc.param else None)
    if len(append.audio) > max_input_bytes:
        return Refusal(
            "input_backpressure",
            f"an append of {len(append.audio)} bytes is over the session's pending input "
            f"limit of {max_input_bytes} bytes; send smaller appends",
            "input.audio",
        )
    return append


# ---------------------------------------------------------------- the connection


class MapConnection(SocketDriver):
    """One MAP Realtime socket and its session."""

    protocol = "map"
    max_early = MAX_EARLY_EVENTS

    def __init__(
        self,
        websocket: WebSocket,
        parts: SessionParts,
        metrics: ApiMetrics,
        directory: WorkerDirectory,
        query: QueryParams,
        *,
        admission_wait_s: float,
        config_timeout_s: float,
        ready_timeout_s: float,
        max_input_bytes: int,
    ) -> None:
        super().__init__(websocket, parts.attachment, parts.delivery, metrics)
        self.attachment.serve_surface(SURFACE_MAP)  # no resume: the socket is the session
        self.directory = directory
        self.query = query
        self.model = query.get("model") or None
        self.mode = "audio"
        self.admission_wait_s = admission_wait_s
        self.config_timeout_s = config_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.max_input_bytes = max_input_bytes
        self.created = asyncio.Event()  # MAP's session.created went out
        #: the model's audio has come since its last response.done: a forced listen cuts it
        self.speaking = False
        self._init: dict[str, Any] | None = None  # a session.init read before it was asked

    # ------------------------------------------------------------ the driver's hooks

    async def open(self, writer: asyncio.Task[None]) -> bool:
        """The queue (a slot), `session.init`, the open; False once the client was refused
        or left (it was told, or is gone)."""
        try:
            self.mode = mode_from_query(self.query)
        except InitRefused as refused:
            self._end(refused.code, refused.message, refused.param)
            return False
        deadline = time.monotonic() + self.admission_wait_s
        if not await self._queue(deadline):
            return False
        self._say({"type": "session.queue_done"})
        init = await self._init_event()
        if init is None:
            return False
        try:  # on a thread: a voice reference is up to 20 s of audio to decode and encode
            session = await asyncio.to_thread(session_from_init, init, self.model)
        except InitRefused as refused:
            self._end(refused.code, refused.message, refused.param)
            return False
        return await self._open(session, deadline)

    async def ready(self, writer: asyncio.Task[None]) -> bool | Close:
        """Until MAP's session.created went out (True): the model has stepped its prompt.
        The SDK's `connect()` returns then; what a client sends before it is handled
        after it (`early`)."""
        outcome = await self.wait_ready(self.created, writer, self.ready_timeout_s)
        if outcome == "timeout":
            log.warning(
                "session %s: the model did not get ready in time", self.attachment.session_id
            )
            self._end("timeout", "the model did not get ready in time")
        return outcome == "ready"

    async def on_message(self, message: Message) -> Close | None:
        frame = await self._frame(message)
        if frame is not None and self.attachment.live:
            await self._handle(frame)
        return None

    def refuse(self, event: DuplexErrorEvent) -> None:
        self._say(map_refusal(event.error_body()))

    def failed(self) -> Close | None:
        self._end("internal_error", "the server failed on this connection")
        return None

    # ------------------------------------------------------------ before the session

    async def _queue(self, deadline: float, *, queued: bool = False) -> bool:
        """Until a worker of the model has a free slot (True), or the client was refused
        (no such model, or none came free before `deadline`) or left (False). The socket
        is read meanwhile: a `session.close` ends the wait, a `session.init` sent early is
        kept. `queued`: the client was told `session.queued` already."""
        backoff = Backoff(initial_s=0.1, max_s=1.0)
        queued_at: float | None = time.monotonic() if queued else None
        updated_at = queued_at or 0.0
        while True:
            try:
                if await self._room():
                    return True
            except InitRefused as refused:
                self._end(refused.code, refused.message, refused.param)
                return False
            now = time.monotonic()
            if now >= deadline:
                self._end(
                    "resource_exhausted",
                    "duplex_session_capacity_exhausted: no slot of this model came free "
                    "while the session waited",
                )
                return False
            if queued_at is None:
                queued_at = updated_at = now
                self._say({"type": "session.queued"})
            elif now - updated_at >= QUEUE_UPDATE_S:
                updated_at = now
                self._say({"type": "session.queue_update", "waited_s": round(now - queued_at)})
            message = await self.receive(timeout=min(backoff.next_delay(), deadline - now))
            if message is not None and not await self._before_init(message):
                return False

    async def _room(self) -> bool:
        """Whether a native worker of the model has a free slot now (the open decides: two
        clients may see the same one). Raises `InitRefused` when none ever will: the model
        is not served, not a native one, or (mode=video) takes no camera frames."""
        workers = await self.directory.live_workers()
        mine = [w for w in workers if self.model is None or w.model == self.model]
        native = [w for w in mine if w.capabilities.get(NATIVE_CAPABILITY)]
        if self.mode == "video":
            seeing = [w for w in native if w.capabilities.get(IMAGE_CAPABILITY)]
            if native and not seeing:
                raise InitRefused(
                    "invalid_session_config",
                    f"model {native[0].model!r} takes no camera frames: connect with mode=audio",
                    "mode",
                )
            native = seeing
        if any(not w.draining and w.active < w.max_sessions for w in native):
            return True
        if native or not workers or self.model is None:
            return False  # full, or no worker live yet (starting, restarting): wait
        if not mine:
            served = sorted({w.model for w in workers})
            raise InitRefused(
                "invalid_session_config", f"model {self.model!r} is not served; try {served}"
            )
        raise InitRefused(
            "invalid_session_config",
            f"model {self.model!r} is not a native full-duplex (frame-clocked) one: this "
            "protocol serves those only",
            "model",
        )

    async def _init_event(self) -> dict[str, Any] | None:
        """The client's `session.init`, or None once it left, closed, or was too slow (told)."""
        deadline = time.monotonic() + self.config_timeout_s
        while self._init is None:
            message = await self.receive(timeout=max(0.0, deadline - time.monotonic()))
            if message is None:
                self._end("config_timeout", "no session.init within the config timeout")
                return None
            if not await self._before_init(message):
                return None
        return self._init

    async def _before_init(self, message: Message) -> bool:
        """A message before the session exists: a `session.init` is kept, a `session.close`
        ends the socket (False), anything else is refused and the wait goes on."""
        frame = await self._frame(message)
        if frame is None:
            return True
        kind = frame.event["type"]
        if kind == "session.init" and self._init is None:
            self._init = frame.event
        elif kind == "session.close":
            self._say({"type": "session.closed", **map_closed("client_close")})
            return False
        else:
            self._warn(
                "invalid_session_config",
                f"{kind[:80]!r} before the session exists: session.init comes first, after "
                "session.queue_done",
                "type",
            )
        return True

    async def _open(self, session: dict[str, Any], deadline: float) -> bool:
        """The session opened on a worker (True), or the client refused or gone (False). A
        slot taken by another client between the queue and the open sends the client back
        to the queue until `deadline`."""
        backoff = Backoff(initial_s=0.1, max_s=1.0)
        while True:
            try:
                reply = await self.attachment.open(dict(session), None)
            except AttachFailed as failed:
                code, message, param = refusal(failed)
            else:
                self.delivery.created(reply)  # not sent: MAP's comes when the model is ready
                self.metrics.sessions_opened.inc()
                return True
            if code != "resource_exhausted" or time.monotonic() >= deadline:
                self._end(code, message, param)
                return False
            self._say({"type": "session.queued"})
            await asyncio.sleep(backoff.next_delay())  # a slot is freed when a session ends
            if not await self._queue(deadline, queued=True):
                return False
            self._say({"type": "session.queue_done"})  # the SDK sends no second init

    # ------------------------------------------------------------ client -> session

    async def _frame(self, message: Message) -> Frame | None:
        """A client message parsed (`parse_frame`), or None after refusing one that is not.
        A large frame is parsed on a thread: JSON and base64 cost about 5 ms per MiB, and
        the loop serves every socket of the pod."""
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        text = message.get("text")
        if text is not None and len(text) > PARSE_INLINE_MAX_CHARS:
            parsed = await asyncio.to_thread(parse_frame, text, self.mode, self.max_input_bytes)
        else:
            parsed = parse_frame(text, self.mode, self.max_input_bytes)
        if isinstance(parsed, Refusal):
            self._warn(parsed.code, parsed.message, parsed.param)
            return None
        return parsed

    async def _handle(self, frame: Frame) -> None:
        kind = frame.event["type"]
        if kind == "input.append":
            append = frame.append
            if isinstance(append, Refusal):
                self._warn(append.code, append.message, append.param)
                return
            assert append is not None
            if append.hints.get("force_listen") and self.speaking:
                # the SDK's interrupt(): the model's speech is cut now (its queued audio
                # dropped, the model made to listen with its memory kept); the append
                # still carries force_listen for a model that takes it per unit
                self.speaking = False
                await self.command(BargeIn(), None)
            await self.command(append, None)
        elif kind == "session.close":
            await self.command(CloseSession(reason="client_close"), None)
        elif kind == "session.init":
            self._warn("session_exists", "the session is initialised")
        else:
            self._warn("unknown_event", f"unknown client event type {kind[:80]!r}", "type")

    # ------------------------------------------------------------ session -> client

    def _say(self, body: dict[str, Any], wire_type: str | None = None) -> None:
        """One event of this socket's own, queued behind the session's."""
        if body["type"] in ("error", MAP_WARNING):
            code = body[body["type"]].get("code")
            self.metrics.errors.labels(code or "unknown").inc()
        self.delivery.queue.put(OutItem(orjson.dumps(body), wire_type or body["type"]))

    def _warn(self, code: str, message: str, param: str | None = None) -> None:
        """A refusal the session outlives (MAP's SDK would end the session on an `error`)."""
        error = {"type": error_type_for(code), "code": code, "message": message}
        self._say(map_refusal({**error, "param": param}, ends=False))

    def _end(self, code: str, message: str, param: str | None = None) -> None:
        """The error the socket closes after (the open returned False)."""
        error = {"type": error_type_for(code), "code": code, "message": message}
        self._say(map_refusal({**error, "param": param}, ends=True), FINAL_ERROR)

    async def send_item(self, item: OutItem) -> bool:
        wire_type = item.wire_type
        if wire_type == "session.created":
            self.attachment.created_delivered()  # ours: MAP's comes with the model's readiness
        elif wire_type == MAP_READY:
            event = orjson.loads(item.data)
            event["type"] = "session.created"
            await self.ws.send_text(orjson.dumps(event).decode())
            self.created.set()
        elif wire_type == FINAL_ERROR:
            await self.ws.send_text(item.data.decode())  # this socket's own: said as it is
        elif wire_type == "error":
            await self.ws.send_text(_map_error_json(item.data))
        elif wire_type in ENDINGS:
            await self.ws.send_text(_map_closed_json(item.data, wire_type))
            await self.ws.close(1000)
            return False
        else:
            if wire_type == "response.output_audio.delta":
                self.speaking = True
            elif wire_type == "response.done":
                self.speaking = False
            await self.ws.send_text(item.data.decode())
        return True


def _map_error_json(data: bytes) -> str:
    """An error as MAP has it. The worker's projection sends `error` only for an error the
    session ends on; the pod's own (duplex-shaped) and the janitor's are said here the same
    way: `error` when their code ends the session, else a `warning`."""
    event = orjson.loads(data)
    error = event.get("error") if isinstance(event, dict) else None
    body = map_refusal(error if isinstance(error, dict) else {"code": "internal_error"})
    if isinstance(event, dict) and isinstance(event.get("event_id"), str):
        body["event_id"] = event["event_id"]
    return orjson.dumps(body).decode()


def _map_closed_json(data: bytes, wire_type: str) -> str:
    """`session.closed {reason}`. The worker's projection already is; a closure published
    without the session's worker (the janitor's), an expiry or a journal gone is said so."""
    event = orjson.loads(data)
    event = event if isinstance(event, dict) else {}
    reason = event.get("reason") if wire_type == "session.closed" else None
    body: dict[str, Any] = {"type": "session.closed"}
    if isinstance(event.get("event_id"), str):
        body["event_id"] = event["event_id"]
    body.update(map_closed(reason if isinstance(reason, str) else wire_type.split(".", 1)[1]))
    return orjson.dumps(body).decode()
