"""`/api/chat`: Moshi's binary WebSocket protocol, for native (frame-clocked) models.

The protocol of kyutai's `moshi.server` and NVIDIA's PersonaPlex server, which LiveKit's
PersonaPlex plugin (`livekit.plugins.nvidia.experimental.realtime`) and Moshi's web client
speak. Each message is binary, its first byte its kind:

- `0x00` (server): the handshake, sent once the session's model has opened its slot and
  stepped its prompt (the persona and voice prompt of PersonaPlex);
- `0x01` (both ways): Ogg Opus pages, 24 kHz mono, one 80 ms frame per message from the
  server (the first message of each side carries the Opus headers);
- `0x02` (server): UTF-8 text, the model's words as it says them.

The query names the session: `text_prompt` (the persona: the session's `instructions`),
`voice_prompt` (PersonaPlex's voice, by the file name its users know: `NATF2.pt`; Moshi
has none and ignores it), `seed` (an integer, accepted and ignored: every session of a
batch samples from one generator) and `model` (ours: which served model, when several).

The key: the plugin sends no header, and its URL is `{base_url}/api/chat?...`, so a
deployment with API keys takes the key as a path prefix of the base URL
(`ws://host/key/<API_KEY>` makes `/key/<API_KEY>/api/chat`; Moshi's web client takes it
the same way, in its `worker_addr`), or as `?api_key=`, or in an `Authorization: Bearer`
header.

Refusals come before the upgrade, as HTTP statuses with OpenAI's error body: 401 (key),
403 (origin), 400 (a bad query, an unknown voice, a model that is not native), 429 (every
native worker full, or none live, for `admission_wait_s`), 504 (no answer from the
worker). The client then stops: a close instead would make it reconnect at once, forever.
A full server is waited on first, as a client of kyutai's `moshi.server` waits for its one
conversation lock (there after the upgrade and without a limit; here before it, for
`admission_wait_s`): a client that just closed its session gets its slot back on the next.

The client's audio is the session's clock, as in `moshi.server`: the worker steps a
Moshi-protocol session once per 80 ms frame of the client's audio that has arrived, and
every step's audio comes back as one `MOSHI_AUDIO` record, silence included, which goes out
as one `0x01` message. So the client gets a frame for every frame it sends, whether the
model speaks or listens, and nothing while it sends nothing. The protocol has no keepalive
message (`moshi.server` sends none): a silent socket is kept open through proxies by the
WebSocket pings of the pod's server (uvicorn: one every 20 s).

Audio the client sends before the handshake (moshi's command-line client sends from the
connect; `moshi.server` sends its handshake at once and then reads what came meanwhile) is
kept, the first `EARLY_MESSAGES` audio messages (2 s of 80 ms frames), and reaches the model
after the handshake; later ones are dropped (logged once): the first ones are kept because
the first carries the Opus headers, without which nothing after it decodes.

After the upgrade the session is the socket's: a dropped socket ends it (this protocol has
no resume; no disconnect grace is held). The session ends the socket with a close: 1000
when it ended normally (the client reconnects at once, a new conversation), 1011 when it
ended on an error, its reason the code (the client backs off: a lost worker, an overflow, a
slot that could not start before the handshake), 1007 for audio that is not Ogg Opus, 1003
for a text frame. The socket is read while the handshake is awaited: a client that leaves
frees its slot at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson
from starlette.datastructures import QueryParams
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.api.attachment import AttachFailed
from services.api.delivery import SessionParts
from services.api.door import Door, deny
from services.api.metrics import ApiMetrics
from services.api.ogg_opus import (
    FRAME_SAMPLES,
    MAX_MESSAGE_BYTES,
    SAMPLE_RATE,
    EncoderThread,
    OggOpusError,
    OpusDecoder,
    new_encoder,
)
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
    MOSHI_AUDIO,
    SURFACE_KEY,
    SURFACE_MOSHI,
    AppendAudio,
    DuplexErrorEvent,
    error_type_for,
)

log = logging.getLogger(__name__)

HANDSHAKE = b"\x00"
AUDIO = 0x01
TEXT = 0x02
#: the client's audio messages sent before the handshake that are kept for the model: 2 s of
#: 80 ms frames (the worker steps such a backlog between its ticks). Each is at most
#: `MAX_MESSAGE_BYTES` and its kind byte, so a socket holds at most 1.6 MiB of them, and only
#: until the handshake
EARLY_MESSAGES = 2 * SAMPLE_RATE // FRAME_SAMPLES
#: the model's words, as the worker's projection passes them (native_surfaces.py)
WORDS = frozenset({"response.output_audio_transcript.delta", "response.output_text.delta"})
#: what ends the socket besides the closures (the journal is gone: nothing can continue)
ENDINGS = CLOSURE_TYPES | {"session.resync_required"}
#: the error class of an open's refusal -> the HTTP status of the upgrade's refusal
REFUSAL_STATUS = {"invalid_request_error": 400, "rate_limit_error": 429, "server_error": 503}
#: the closure reasons of a session that ended without an error: its socket closes 1000
#: (the client reconnects at once); any other reason closes it 1011 (the client backs off)
NORMAL_ENDS = frozenset(
    {
        "client_close",
        "disconnect",
        "timeout",
        "shutdown",
        "admin_close",
        "idle_ttl_expired",
        "disconnect_grace_expired",
        "request_cleanup",
        "session_created_undelivered",
        "open_abandoned",
    }
)
#: WebSocket close codes (RFC 6455)
NORMAL, UNSUPPORTED_DATA, INVALID_DATA, SERVER_ERROR = 1000, 1003, 1007, 1011


#: the route, also under a key prefix for clients that can only set a base URL:
#: `/key/<API_KEY>/api/chat`
MOSHI_CHAT_PATH = "/api/chat"
KEY_PREFIX = "/key/"


def moshi_chat_path(path: str) -> str | None:
    """For Moshi's route: the key in its path ("" when it has none); None for another."""
    if path == MOSHI_CHAT_PATH:
        return ""
    if path.startswith(KEY_PREFIX) and path.endswith(MOSHI_CHAT_PATH):
        key = path[len(KEY_PREFIX) : -len(MOSHI_CHAT_PATH)]
        if key and "/" not in key:
            return key  # the ASGI path is percent-decoded already
    return None


class MoshiChatEndpoint(SocketEndpoint):
    """The door of `/api/chat`: the key, the query, the open (waiting for a free slot),
    then the upgrade, and the connection."""

    def __init__(
        self,
        door: Door,
        metrics: ApiMetrics,
        parts: PartsFactory,
        *,
        admission_wait_s: float,
        handshake_timeout_s: float,
    ) -> None:
        self.door = door
        self.metrics = metrics
        self.parts = parts
        self.admission_wait_s = admission_wait_s
        self.handshake_timeout_s = handshake_timeout_s
        #: every session's Opus encoding, off the event loop (services/api/ogg_opus.py)
        self.encoder_thread = EncoderThread()

    def close(self) -> None:
        self.encoder_thread.close()

    def match(self, path: str) -> tuple[str | None] | None:
        key = moshi_chat_path(path)
        return None if key is None else (key or None,)

    async def __call__(self, websocket: WebSocket, path_key: str | None) -> None:  # type: ignore[override]
        admitted = await self.door.admit(websocket, path_key)
        if admitted is None:
            return
        try:
            session = session_from_query(admitted.query)
        except ValueError as exc:
            await deny(websocket, 400, "invalid_session_config", str(exc), param="seed")
            return
        parts = await self._open(websocket, session, admitted.key)
        if parts is None:
            return
        try:
            # the client may be gone by now (it waited for a slot): its session goes too
            await websocket.accept()
        except BaseException:
            await parts.attachment.release()
            raise
        self.metrics.sessions_opened.inc()
        self.metrics.active_sessions.inc()
        try:
            await MoshiConnection(
                websocket, parts, self.metrics, self.handshake_timeout_s, self.encoder_thread
            ).run()
        finally:
            self.metrics.active_sessions.dec()

    async def _open(
        self, websocket: WebSocket, session: dict[str, Any], key: str | None
    ) -> SessionParts | None:
        """The session opened on a worker, or None once the client was refused. A full
        server is asked again until `admission_wait_s` has passed."""
        deadline = time.monotonic() + self.admission_wait_s
        backoff = Backoff(initial_s=0.1, max_s=1.0)
        while True:
            parts = self.parts(key)
            parts.attachment.serve_surface(SURFACE_MOSHI)  # no resume: the socket is the session
            try:
                reply = await parts.attachment.open(dict(session), None)
            except AttachFailed as failed:
                code, message, param = refusal(failed)
            except BaseException:  # Redis failed, or the door was cancelled mid-open
                await parts.attachment.release()
                raise
            else:
                parts.delivery.created(reply)
                return parts
            delay = backoff.next_delay()
            if code == "resource_exhausted" and time.monotonic() + delay < deadline:
                await asyncio.sleep(delay)  # a slot is freed when a session closes
                continue
            status = 429 if code == "resource_exhausted" else status_for(code)
            if code == "timeout":
                status = 504
            await deny(websocket, status, code, message, param)
            return None


def session_from_query(query: QueryParams) -> dict[str, Any]:
    """The opening session object of a `/api/chat` query (ValueError: a bad `seed`)."""
    seed = query.get("seed")
    if seed is not None:
        try:
            int(seed)
        except ValueError:
            raise ValueError(f"seed must be an integer, got {seed[:40]!r}") from None
    session: dict[str, Any] = {SURFACE_KEY: SURFACE_MOSHI}
    if model := query.get("model"):
        session["model"] = model
    if text_prompt := query.get("text_prompt"):
        session["instructions"] = text_prompt
    if voice := query.get("voice_prompt"):
        session["voice"] = voice
    return session


def status_for(code: str) -> int:
    return REFUSAL_STATUS.get(error_type_for(code), 400)


class MoshiConnection(SocketDriver):
    """One upgraded `/api/chat` socket and its session: Ogg Opus in, Ogg Opus and words out.
    Its session was opened at the door, before the upgrade."""

    protocol = "moshi"

    def __init__(
        self,
        websocket: WebSocket,
        parts: SessionParts,
        metrics: ApiMetrics,
        handshake_timeout_s: float,
        encoder_thread: EncoderThread,
    ):
        super().__init__(websocket, parts.attachment, parts.delivery, metrics)
        self.handshake_timeout_s = handshake_timeout_s
        self.decoder = OpusDecoder()
        self.encoder = new_encoder()
        self.encoder_thread = encoder_thread
        self.handshaken = asyncio.Event()
        self.early_dropped = 0  # messages sent before the handshake and not kept

    # ------------------------------------------------------------ the driver's hooks

    async def open(self, writer: asyncio.Task[None]) -> bool:
        return True  # opened at the door (`MoshiChatEndpoint._open`)

    async def ready(self, writer: asyncio.Task[None]) -> bool | Close:
        """Until the handshake went out. The audio the client sends before it is kept
        (`keep_early`) and reaches the model after it, as `moshi.server`'s socket keeps
        what came before its handshake; a client that leaves, or a session that ends
        first, ends the socket; a model that takes too long closes it 1011."""
        outcome = await self.wait_ready(self.handshaken, writer, self.handshake_timeout_s)
        if outcome == "timeout":
            sid = self.attachment.session_id
            log.warning("session %s: the model did not get ready in time", sid)
            return (SERVER_ERROR, "the model did not get ready in time")
        if outcome == "ended":
            raise WebSocketDisconnect(NORMAL)
        return True

    def keep_early(self, message: Message) -> bool:
        """The first `EARLY_MESSAGES` audio messages of at most `MAX_MESSAGE_BYTES` are kept
        (the first carries the Opus headers: a later one is the one dropped); anything else
        is dropped, the first drop logged."""
        data = message.get("bytes")
        if data and data[0] == AUDIO and len(data) <= MAX_MESSAGE_BYTES + 1:
            if len(self.early) < EARLY_MESSAGES:
                return True
            why = f"audio past the first {EARLY_MESSAGES} messages"
        elif data and data[0] == AUDIO:
            why = f"an audio message over {MAX_MESSAGE_BYTES} bytes"
        else:
            why = "a message that is not audio"
        if not self.early_dropped:
            sid = self.attachment.session_id
            log.warning("session %s: dropped before the handshake: %s (logged once)", sid, why)
        self.early_dropped += 1
        return False

    async def on_message(self, message: Message) -> Close | None:
        data = message.get("bytes")
        if data is None:
            return (UNSUPPORTED_DATA, "send binary messages (Moshi's protocol)")
        if not data or data[0] != AUDIO:
            return None  # the protocol's other kinds are the server's; ignored as the
            # reference servers do
        try:
            pcm = self.decoder.decode(data[1:])
        except OggOpusError as exc:
            return (INVALID_DATA, str(exc)[:120])
        if pcm:
            # a frame refused (the worker is behind: its inbox is full) is lost, the model
            # hears the next ones (`refuse`): a frame it never stepped on, and one the
            # client gets no frame back for
            await self.command(
                AppendAudio(audio=pcm, format="pcm16", sample_rate_hz=SAMPLE_RATE), None
            )
        return None

    def refuse(self, event: DuplexErrorEvent) -> None:
        # the protocol has no error message: the client's input is dropped, and said here
        log.warning("session %s: input dropped: %s", self.attachment.session_id, event.code)

    def failed(self) -> Close | None:
        return (SERVER_ERROR, "internal_error")

    async def send_item(self, item: OutItem) -> bool:
        wire_type = item.wire_type
        if wire_type == "session.created":
            self.attachment.created_delivered()
        elif wire_type == "session.started":
            if not self.handshaken.is_set():
                await self.ws.send_bytes(HANDSHAKE)
                self.handshaken.set()
        elif wire_type == "error":
            # the protocol has no error message: logged; an error that ends the session
            # comes back as its closure's reason (`_end`)
            code = _error_code(item.data)
            log.info("session %s: error %s", self.attachment.session_id, code)
        elif wire_type in ENDINGS:
            await self._end(item.data)
            return False
        elif not self.handshaken.is_set():
            pass  # the model's output is never sent before the handshake
        elif wire_type == MOSHI_AUDIO:  # one step's pcm16 as it crossed Redis, a frame
            # One continuous Opus stream, whether the model speaks or listens: nothing is
            # flushed at a response's end (a padded partial frame would put samples into
            # it that the model never made; a step's frame is whole, so none waits anyway).
            # Encoded on the pod's encoder thread: the loop serves other sockets meanwhile
            await self._audio(await self.encoder_thread.encode(self.encoder, item.data))
        elif wire_type in WORDS:
            text = orjson.loads(item.data).get("delta") or ""
            if text:
                await self.ws.send_bytes(bytes((TEXT,)) + text.encode())
        return True

    async def _audio(self, pages: list[bytes]) -> None:
        for page in pages:
            await self.ws.send_bytes(bytes((AUDIO,)) + page)

    async def _end(self, data: bytes) -> None:
        """The session ended: the socket closes, normally unless it ended on an error (a
        lost worker, an overflow, a slot that could not open: the client backs off)."""
        event = orjson.loads(data)
        reason = str(event.get("reason") or event.get("type") or "")
        code = NORMAL if reason in NORMAL_ENDS else SERVER_ERROR
        with contextlib.suppress(Exception):
            await self.ws.close(code, reason[:120])


def _error_code(data: bytes) -> str:
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
        return str(orjson.loads(data).get("error", {}).get("code") or "error")
    return "error"
