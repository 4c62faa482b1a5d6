"""`/api/chat`: Moshi's binary WebSocket protocol, for native (frame-clocked) models.

The protocol of kyutai's `moshi.server` and NVIDIA's PersonaPlex server, which LiveKit's
PersonaPlex plugin (`livekit.plugins.nvidia.experimental.realtime`) and Moshi's web client
speak. Each message is binary, its first byte its kind:

- `0x00` (server): the handshake, sent once the session's model has opened its slot and
  stepped its prompt (the persona and voice prompt of PersonaPlex); the client sends
  nothing before it;
- `0x01` (both ways): Ogg Opus pages, 24 kHz mono, one 80 ms frame per message (the
  first message of each side carries the Opus headers);
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
A full server is waited on first, as the reference servers' one conversation lock does: a
client that just closed its session gets its slot back on the next.

The model's audio is sent while it speaks (a response), not as a continuous stream of
silence: LiveKit's plugin then sees one generation per turn of the model. While the model
listens, a padding text message (`0x02 0x00`) goes out every `KEEPALIVE_S` without another.

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
import base64
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
from redis.exceptions import RedisError
from starlette.datastructures import QueryParams
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.api.attachment import AttachFailed
from services.api.delivery import SessionParts
from services.api.inbox_writer import InboxFull
from services.api.metrics import ApiMetrics
from services.api.ogg_opus import SAMPLE_RATE, OggOpusError, OpusDecoder, OpusEncoder
from services.api.output_queue import AUDIO_DELTA, CLOSURE_TYPES
from services.api.realtime import admit_native, deny
from services.api.security import KeyChecker
from shared.backoff import Backoff
from shared.protocol.duplex import SURFACE_KEY, SURFACE_MOSHI, AppendAudio, error_type_for

log = logging.getLogger(__name__)

HANDSHAKE = b"\x00"
#: sent after `KEEPALIVE_S` without another message: a text message of one padding byte,
#: which the reference servers send too (LiveKit's plugin drops it; Moshi's web client hangs
#: up after 10 s without a message, and a listening model sends none)
KEEPALIVE = b"\x02\x00"
KEEPALIVE_S = 5.0
AUDIO = 0x01
TEXT = 0x02
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

PartsFactory = Callable[[str | None], SessionParts]


class MoshiChatEndpoint:
    """The door of `/api/chat`: the key, the query, the open (waiting for a free slot),
    then the upgrade, and the connection."""

    def __init__(
        self,
        authorized: KeyChecker,
        allowed_origins: frozenset[str],
        metrics: ApiMetrics,
        parts: PartsFactory,
        *,
        admission_wait_s: float,
        handshake_timeout_s: float,
    ) -> None:
        self.authorized = authorized
        self.allowed_origins = allowed_origins
        self.metrics = metrics
        self.parts = parts
        self.admission_wait_s = admission_wait_s
        self.handshake_timeout_s = handshake_timeout_s

    async def __call__(self, websocket: WebSocket, path_key: str | None) -> None:
        admitted = await admit_native(websocket, self.authorized, self.allowed_origins, path_key)
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
        websocket.scope["headers"] = []  # read: not kept for the socket's life
        try:
            # the client may be gone by now (it waited for a slot): its session goes too
            await websocket.accept()
        except BaseException:
            await parts.attachment.release()
            raise
        self.metrics.sessions_opened.inc()
        self.metrics.active_sessions.inc()
        try:
            await MoshiConnection(websocket, parts, self.handshake_timeout_s).run()
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
            parts.attachment.duplex = False  # no resume: the socket is the session
            parts.attachment.native_only = True
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


def refusal(failed: AttachFailed) -> tuple[str, str, str | None]:
    """(code, message, param) of a refused open: the pod's event or the worker's reply."""
    event = failed.event.to_dict() if failed.event is not None else failed.reply or {}
    error = event.get("error")
    error = error if isinstance(error, dict) else {}
    return (
        str(error.get("code") or "server_error"),
        str(error.get("message") or "the session could not be opened"),
        error.get("param"),
    )


def status_for(code: str) -> int:
    return REFUSAL_STATUS.get(error_type_for(code), 400)


class MoshiConnection:
    """One upgraded `/api/chat` socket and its session: Ogg Opus in, Ogg Opus and words out."""

    def __init__(self, websocket: WebSocket, parts: SessionParts, handshake_timeout_s: float):
        self.ws = websocket
        self.attachment = parts.attachment
        self.delivery = parts.delivery
        self.handshake_timeout_s = handshake_timeout_s
        self.decoder = OpusDecoder()
        self.encoder = OpusEncoder()
        self.handshaken = asyncio.Event()
        #: a client message read while the handshake went out, for the reader
        self.early: dict[str, Any] | None = None

    async def run(self) -> None:
        writer = asyncio.create_task(self._writer(), name="moshi-writer")
        pump = asyncio.create_task(
            self.delivery.pump(), name=f"moshi-live:{self.attachment.session_id}"
        )
        close: tuple[int, str] | None = None
        try:
            close = await self._await_handshake(writer)
            if close is None:
                close = await self._reader(writer)
        except WebSocketDisconnect:
            pass
        except Exception:
            log.exception("moshi connection of %s failed", self.attachment.session_id)
            close = (SERVER_ERROR, "internal_error")
        finally:
            # the socket is gone, or the session ended (the writer closed the socket after
            # its closure), or the close is ours: nothing is left to send either way
            pump.cancel()
            writer.cancel()
            await self.attachment.release()  # the session ends with its socket
            if close is not None:
                with contextlib.suppress(Exception):
                    await self.ws.close(*close)

    async def _await_handshake(self, writer: asyncio.Task[None]) -> tuple[int, str] | None:
        """Until the handshake went out (None), the session ended first, the client left
        (both: WebSocketDisconnect), or the model took too long (the close to send). The
        socket is read meanwhile, so that a client that leaves frees its slot at once; what
        it sends before the handshake is dropped, as the reference servers drop it."""
        handshake = asyncio.create_task(self.handshaken.wait())
        deadline = time.monotonic() + self.handshake_timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    sid = self.attachment.session_id
                    log.warning("session %s: the model did not get ready in time", sid)
                    return (SERVER_ERROR, "the model did not get ready in time")
                message = await next_message(self.ws, handshake, writer, timeout=remaining)
                if handshake.done():
                    # a message read as the handshake went out may have been sent after it
                    if message is not None:
                        self.early = message
                    return None
                if writer.done() or (message and message["type"] == "websocket.disconnect"):
                    raise WebSocketDisconnect(NORMAL)
        finally:
            handshake.cancel()

    # ------------------------------------------------------------ client -> model

    async def _reader(self, writer: asyncio.Task[None]) -> tuple[int, str] | None:
        """Until the socket or the session ends; the close to send, if it is ours."""
        while True:
            message, self.early = self.early or await next_message(self.ws, writer), None
            if message is None or message["type"] == "websocket.disconnect":
                return None  # the session ended (the writer closed the socket), or the client
            data = message.get("bytes")
            if data is None:
                return (UNSUPPORTED_DATA, "send binary messages (Moshi's protocol)")
            if not data or data[0] != AUDIO:
                continue  # the protocol's other kinds are the server's; ignored as the
                # reference servers do
            try:
                pcm = self.decoder.decode(data[1:])
            except OggOpusError as exc:
                return (INVALID_DATA, str(exc)[:120])
            if pcm:
                await self._append(pcm)

    async def _append(self, pcm: bytes) -> None:
        append = AppendAudio(audio=pcm, format="pcm16", sample_rate_hz=SAMPLE_RATE)
        try:
            await self.attachment.command(append)
        except InboxFull:
            # the worker is behind: this frame is lost, the model hears the next ones
            log.warning("session %s: input dropped (worker inbox full)", self.attachment.session_id)
        except RedisError as exc:
            log.warning("session %s: input not delivered: %s", self.attachment.session_id, exc)

    # ------------------------------------------------------------ model -> client

    async def _writer(self) -> None:
        while True:
            try:
                async with asyncio.timeout(KEEPALIVE_S):
                    item = await self.delivery.get()
            except TimeoutError:
                if self.handshaken.is_set():  # the model listens: nothing else to send
                    await self.ws.send_bytes(KEEPALIVE)
                continue
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
                return
            elif not self.handshaken.is_set():
                continue  # the model's output is never sent before the handshake
            elif wire_type == AUDIO_DELTA:
                pcm = base64.b64decode(orjson.loads(item.data)["delta"])
                await self._audio(self.encoder.encode(pcm))
            elif wire_type in WORDS:
                text = orjson.loads(item.data).get("delta") or ""
                if text:
                    await self.ws.send_bytes(bytes((TEXT,)) + text.encode())
            elif wire_type == "response.done":
                await self._audio(self.encoder.flush())  # the response's tail, padded

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


async def next_message(
    websocket: WebSocket, *ends: asyncio.Future[Any], timeout: float | None = None
) -> dict[str, Any] | None:
    """The socket's next message, or None when one of `ends` finished first (or `timeout`
    passed): a reader that waits on the client alone would miss its session's end."""
    receive = asyncio.ensure_future(websocket.receive())
    try:
        await asyncio.wait((receive, *ends), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not receive.done():
            receive.cancel()  # nothing taken: the socket's queue gives it to the next read
    return receive.result() if receive.done() and not receive.cancelled() else None


def _error_code(data: bytes) -> str:
    with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
        return str(orjson.loads(data).get("error", {}).get("code") or "error")
    return "error"
