"""One client WebSocket attached to one session: handshake, commands in, events out.

The connection holds nothing that must outlive it: the session lives on its
worker, its lease and journal live in Redis. What it keeps is its attachment
generation, the last `server_event_seq` it delivered, and its send queue.

Order of a resume (Centrifugo's recovery rule): subscribe to the live channel
first, then take the lease (Lua CAS), then replay the journal from
`last_received_server_event_seq + 1`, then deliver live messages above the
replayed seq. A live message past a gap is preceded by the journal entries in
between, so delivery is contiguous or `session.resync_required`, never a hole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import orjson
from redis.exceptions import RedisError
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.api.inbox_writer import InboxFull
from services.api.live import CATCH_UP
from services.api.output_queue import CLOSURE_TYPES, OutItem, OutputQueue
from shared.ids import new_session_id
from shared.protocol.duplex import (
    AppendAudio,
    CloseSession,
    CommandContext,
    DuplexErrorEvent,
    DuplexEvent,
    DuplexSessionCreated,
    Heartbeat,
    InputAudioDefaults,
    RealtimeProtocolError,
    SessionEventAck,
    SessionReplaced,
    SessionResume,
    SessionResumed,
    SessionResyncRequired,
    UpdateSession,
    parse_client_event,
)
from shared.redis.command_messages import command_message
from shared.redis.messages import (
    CLOSE,
    COMMAND,
    CONTROL_PREFIX,
    OPEN,
    TAKEOVER,
    TOUCH,
    InboxMessage,
    takeover_notice,
)
from shared.redis.store import ResumeResync, SessionStoreError, key_digest, token_digest

if TYPE_CHECKING:
    from services.api.app import ApiPod

log = logging.getLogger(__name__)


#: frames longer than this are parsed off the event loop (a 20 ms pcm16 append is ~1 KiB)
PARSE_INLINE_MAX_CHARS = 256 * 1024


#: client commands that pass a worker's full inbox: small, and what keeps a session alive
#: or stops it (everything else, appends first, counts against the inbox's budget)
UNBUDGETED = frozenset(
    {
        "session.heartbeat",
        "session.close",
        "response.cancel",
        "input.cancel",
        "barge_in",
        "input_audio_buffer.clear",
        "output_audio_buffer.clear",
        "playback.ack",
    }
)


class HandshakeFailed(Exception):
    """The connection could not open or resume a session; the client was told why."""


class RealtimeConnection:
    def __init__(
        self,
        websocket: WebSocket,
        pod: ApiPod,
        *,
        model: str | None,
        autostart: bool,
        resume_only: bool,
        api_key: str | None = None,
    ):
        self.ws = websocket
        self.pod = pod
        # the session is bound to the key that opened it: only that key may resume it
        self.key_sha = key_digest(api_key) if pod.settings.api_keys and api_key else ""
        self.model = model
        self.autostart = autostart and not resume_only
        self.resume_only = resume_only
        runtime = pod.runtime
        self.queue = OutputQueue(
            runtime.max_pending_output_bytes_per_session,
            runtime.max_pending_output_events_per_session,
            runtime.output_reserve_bytes,
            runtime.output_reserve_events,
        )
        self.live: asyncio.Queue[bytes] = asyncio.Queue()
        self.session_id: str | None = None
        self.worker_id: str | None = None
        self.generation = 0
        self.resumable = False
        self.opened_here = False
        self.created_sent = False
        self.closed = False  # the session ended (session.closed / expired seen)
        self.replaced = False
        self.last_seq = 0
        self.command_seq = 0
        self.defaults = InputAudioDefaults()  # sets self.context too
        self.idle_timeout_s = 300.0
        self._overflow_handled = False

    @property
    def defaults(self) -> InputAudioDefaults:
        return self._defaults

    @defaults.setter
    def defaults(self, value: InputAudioDefaults) -> None:
        # one parse context per change, not per frame: appends arrive every 20 ms
        self._defaults = value
        self.context = CommandContext(value)

    # ------------------------------------------------------------ main

    async def run(self) -> None:
        writer = asyncio.create_task(self._writer(), name="ws-writer")
        pump: asyncio.Task[None] | None = None
        try:
            first = await self._handshake()
            if self.session_id is None:
                return
            pump = asyncio.create_task(self._live_pump(), name=f"ws-live:{self.session_id}")
            if first is not None:
                await self._handle_frame(first)
            await self._reader(writer)
        except (HandshakeFailed, WebSocketDisconnect):
            pass
        except Exception:
            log.exception("connection of session %s failed", self.session_id)
            self._error(
                "internal_error", "the server failed on this connection; resume or reconnect"
            )
        finally:
            if pump is not None:
                pump.cancel()
            await self._release()
            if not writer.done():
                with contextlib.suppress(TimeoutError, Exception):
                    async with asyncio.timeout(5.0):
                        await self._drain_then_close()
                writer.cancel()

    async def _drain_then_close(self) -> None:
        await self.queue.drained()  # the writer has taken everything queued
        with contextlib.suppress(Exception):
            await self.ws.close(1000)

    # ------------------------------------------------------------ handshake

    async def _handshake(self) -> str | None:
        """Open or resume. Returns a first frame still to be handled as a command."""
        if self.autostart and self.model:
            await self._open({"model": self.model})
            return None
        deadline = time.monotonic() + self.pod.settings.config_timeout_s
        while True:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    frame = await self._receive_text()
            except TimeoutError:
                self._error(
                    "config_timeout",
                    "no session.update or session.resume within the config timeout",
                )
                raise HandshakeFailed from None
            try:
                event = await self._parse(frame)
            except RealtimeProtocolError as exc:
                self._send_event(DuplexErrorEvent.from_exception(exc))
                continue
            if isinstance(event, SessionResume):
                await self._resume(event)
                return None
            if isinstance(event, UpdateSession):
                await self._open(event.patch)
                return None
            if self.resume_only:
                self._error(
                    "invalid_session_config",
                    "the first message must be session.update or session.resume",
                    event.event_id,
                )
                continue
            await self._open({"model": self.model} if self.model else {})
            return frame

    async def _open(self, session: dict[str, Any]) -> None:
        pod = self.pod
        requested = session.get("model")
        if requested is not None and (not isinstance(requested, str) or not requested.strip()):
            # `model: []` (or 0, or "") must not silently open the default model
            self._error(
                "invalid_session_config",
                "session.model must be a model name (a non-empty string)",
                param="session.model",
            )
            raise HandshakeFailed
        model = requested or self.model
        session_id = new_session_id()
        candidates = await pod.directory.candidates(model, session_id)
        if not candidates:
            served = await pod.directory.models()
            if model and served and model not in served:
                self._error(
                    "invalid_session_config", f"model {model!r} is not served; try {served}"
                )
            elif model in served or (not model and served):
                self._error(
                    "resource_exhausted",
                    "duplex_session_capacity_exhausted: every worker of this model is full",
                    retryable=True,
                )
            else:
                self._error(
                    "resource_exhausted", "no live worker serves this model", retryable=True
                )
            raise HandshakeFailed
        token = secrets.token_urlsafe(32)
        await pod.hub.subscribe(pod.keys.live(session_id), self._on_live)
        self.session_id = session_id
        # indexed under this pod before the client can know the session: should the pod
        # die right after, the dead-pod sweep finds it (it checks the hash's `pod` field)
        await pod.client.sadd(pod.keys.api_sessions(pod.settings.pod_id), session_id)
        for worker in candidates:
            resumable = bool(worker.capabilities.get("supports_session_resume"))
            payload = {**session, "model": worker.model}
            await pod.store.open(
                session_id,
                worker.worker_id,
                worker.model,
                token_digest(token) if resumable else "",
                orjson.dumps(payload).decode(),
                pod.settings.pod_id,
                self.key_sha,
            )
            await self._xadd(
                worker.worker_id, InboxMessage(OPEN, session_id, 1, 0, {"session": payload})
            )
            reply = await self._first_reply()
            if reply is not None and reply.get("type") == "session.created":
                self.worker_id, self.generation, self.resumable = worker.worker_id, 1, resumable
                self.opened_here = True
                pod.liveness.attach(session_id, 1)
                if resumable:
                    reply["resume_token"] = token
                    reply["attachment_generation"] = 1
                reply["duplex_worker_id"] = worker.worker_id  # for consoles and debugging
                self._observe_session(reply.get("session"))
                self.queue.put(OutItem(orjson.dumps(reply), "session.created"))
                pod.metrics.sessions_opened.inc()
                return
            await pod.client.delete(pod.keys.session(session_id), pod.keys.events(session_id))
            code = (reply or {}).get("error", {}).get("code") if reply else None
            if code == "resource_exhausted":
                continue  # a race with another pod: walk on to the next worker
            await self._abandon_open(session_id)
            if reply is None:
                self._error("timeout", "the worker did not answer the open in time", retryable=True)
            else:
                self._enqueue_raw(orjson.dumps(reply), reply)
            raise HandshakeFailed
        await self._abandon_open(session_id)
        self._error("resource_exhausted", "every worker of this model is full", retryable=True)
        raise HandshakeFailed

    async def _abandon_open(self, session_id: str) -> None:
        self.session_id = None
        await self.pod.hub.unsubscribe(self.pod.keys.live(session_id), self._on_live)
        await self.pod.client.srem(self.pod.keys.api_sessions(self.pod.settings.pod_id), session_id)

    async def _first_reply(self) -> dict[str, Any] | None:
        """The worker's answer to an open: session.created or an error (control notices skipped).

        session.created is not journaled: if its live message was missed (the pub/sub
        connection was reconnecting, which the hub announces with CATCH_UP), the session
        hash, which the same script marked active with the session object, stands in for
        it. The hash is read then, and once more when the open timeout runs out."""
        try:
            async with asyncio.timeout(self.pod.settings.open_timeout_s):
                while True:
                    data = await self.live.get()
                    if data == CATCH_UP:
                        if (created := await self._created_from_hash()) is not None:
                            return created
                    elif not data.startswith(CONTROL_PREFIX):
                        return orjson.loads(data)
        except TimeoutError:
            return await self._created_from_hash()

    async def _created_from_hash(self) -> dict[str, Any] | None:
        meta = await self.pod.store.meta(self.session_id)
        if meta.get("state") == "active" and meta.get("session"):
            return DuplexSessionCreated(session=orjson.loads(meta["session"])).to_dict()
        return None

    async def _resume(self, request: SessionResume) -> None:
        pod, sid = self.pod, request.session_id
        await pod.hub.subscribe(
            pod.keys.live(sid), self._on_live
        )  # first: nothing published after the CAS is missed
        new_token = secrets.token_urlsafe(32)
        try:
            result = await pod.store.resume(
                sid,
                request.resume_token,
                new_token,
                request.last_received_server_event_seq,
                pod.settings.pod_id,
                self.key_sha,
            )
        except SessionStoreError as exc:
            await pod.hub.unsubscribe(pod.keys.live(sid), self._on_live)
            self._error(exc.code, f"cannot resume {sid}: {exc.code}", request.event_id)
            raise HandshakeFailed from None
        if isinstance(result, ResumeResync):
            await pod.hub.unsubscribe(pod.keys.live(sid), self._on_live)
            self._send_event(SessionResyncRequired(session_id=sid, reason=result.reason))
            raise HandshakeFailed
        self.session_id, self.worker_id = sid, result.worker_id
        self.generation, self.resumable = result.attachment_generation, True
        pod.liveness.attach(sid, self.generation)
        await pod.client.sadd(pod.keys.api_sessions(pod.settings.pod_id), sid)
        await pod.hub.publish(pod.keys.live(sid), takeover_notice(self.generation))
        session = orjson.loads(result.session) if result.session else {}
        self._observe_session(session)
        self.created_sent = True  # a resumed session is past its creation
        self.queue.put(
            OutItem(
                SessionResumed(
                    session_id=sid,
                    session=session,
                    attachment_generation=self.generation,
                    resume_token=new_token,
                ).to_json(),
                "session.resumed",
            )
        )
        self.last_seq = request.last_received_server_event_seq
        await self._replay(until_seq=None)
        await self._xadd(self.worker_id, InboxMessage(TOUCH, sid, self.generation))
        pod.metrics.resumes.inc()

    async def _replay(self, until_seq: int | None) -> bool:
        """Queue journal entries after `last_seq` (up to `until_seq`); False when some are gone."""
        entries = await self.pod.store.journal(self.session_id, self.last_seq, until_seq)
        for seq, data in entries:
            if seq != self.last_seq + 1:
                return False
            self.last_seq = seq
            self._enqueue_raw(data, orjson.loads(data))
        return until_seq is None or self.last_seq >= until_seq

    # ------------------------------------------------------------ client -> worker

    async def _receive_text(self) -> str:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            if message.get("text") is not None:
                return message["text"]
            self._error("bad_event", "binary frames are not supported: send JSON text frames")

    async def _reader(self, writer: asyncio.Task[None]) -> None:
        while not writer.done():
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    frame = await self._receive_text()
            except TimeoutError:
                return  # an idle socket is a disconnect
            await self._handle_frame(frame)

    async def _parse(self, frame: str) -> Any:
        """A client frame as a command. A large one is parsed on a thread: JSON and base64
        cost about 5 ms per MiB, and a 10 MiB append parsed here held every socket of the
        pod for 40-75 ms (bench/exhaustion.py, inbox_flood). The GIL still makes the loop
        wait for parts of it (20-70 ms). Frames are still handled one at a time, in
        order: the caller awaits this."""
        if len(frame) <= PARSE_INLINE_MAX_CHARS:
            return parse_client_event(frame, self.context)
        return await asyncio.to_thread(parse_client_event, frame, self.context)

    async def _handle_frame(self, frame: str) -> None:
        if self.replaced or self.closed:
            return  # a superseded socket's input is ignored
        try:
            command = await self._parse(frame)
        except RealtimeProtocolError as exc:
            self._send_event(DuplexErrorEvent.from_exception(exc))
            return
        if self.replaced or self.closed:
            return  # taken over (or ended) while a large frame was parsed on a thread
        if isinstance(command, SessionResume):
            self._error(
                "unsupported_session_resume",
                "session.resume is only valid as the first message",
                command.event_id,
            )
            return
        if isinstance(command, AppendAudio) and not self._fits_input_budget(command):
            return
        try:
            await self._deliver(command)
        except InboxFull:
            self._error(
                "input_backpressure",
                "the session's worker has too many unhandled commands; slow down and retry",
                command.event_id,
                retryable=True,
            )
        except RedisError as exc:  # Redis unreachable: the client hears it, the socket lives on
            log.warning("command for %s not delivered: %s", self.session_id, exc)
            self._error(
                "internal_error",
                "the command could not be delivered (the session store is unreachable); retry",
                command.event_id,
                retryable=True,
            )

    def _fits_input_budget(self, command: AppendAudio) -> bool:
        """Refuse at the door an append that alone is over the session's pending-input
        limit: the worker would refuse it anyway, after it had crossed Redis."""
        limit = self.pod.runtime.max_pending_input_bytes_per_session
        if len(command.audio) <= limit:
            return True
        self._error(
            "input_backpressure",
            f"an append of {len(command.audio)} audio bytes is over the session's pending "
            f"input limit of {limit} bytes; send smaller appends",
            command.event_id,
        )
        return False

    async def _deliver(self, command: Any) -> None:
        if isinstance(command, SessionEventAck):
            first = await self.pod.store.ack(self.session_id, command.server_event_seq)
            if first == -1:
                self._error(
                    "invalid_event_ack",
                    "server_event_seq is past the newest event",
                    command.event_id,
                )
            return
        if isinstance(command, UpdateSession):
            # appends sent right after this update use its formats: adopt them now, not when
            # session.updated comes back (the worker refuses an invalid update on its own)
            with contextlib.suppress(RealtimeProtocolError):
                self.defaults = self.defaults.updated(command.patch)
        started = time.perf_counter()
        self.command_seq += 1
        message = command_message(self.session_id, self.generation, self.command_seq, command)
        if isinstance(command, Heartbeat):
            # the lease refresh and the command travel at once: awaiting the touch first put
            # a whole Redis round trip in front of every heartbeat_ack
            await asyncio.gather(
                self.pod.store.touch(self.session_id, self.generation, self.pod.settings.pod_id),
                self._xadd(self.worker_id, message),
            )
        else:
            await self._xadd(self.worker_id, message)
        self.pod.metrics.command_latency.observe(time.perf_counter() - started)
        if isinstance(command, CloseSession):
            self.pod.metrics.sessions_closed.inc()

    async def _xadd(self, worker_id: str | None, message: InboxMessage) -> None:
        # client commands count against the inbox's budget; opens, touches, closes and the
        # small commands that keep a session alive or stop it are never refused, so a
        # session's neighbour flooding the worker cannot cut them off
        budgeted = message.kind == COMMAND and message.payload.get("type") not in UNBUDGETED
        await self.pod.inbox_writer.append(worker_id or "", message.to_fields(), budgeted=budgeted)

    # ------------------------------------------------------------ worker -> client

    def _on_live(self, data: bytes) -> None:
        self.live.put_nowait(data)

    async def _live_pump(self) -> None:
        while True:
            data = await self.live.get()
            if data.startswith(CONTROL_PREFIX):
                if data.startswith(TAKEOVER) and int(data[len(TAKEOVER) :]) > self.generation:
                    self.replaced = True
                    self._send_event(
                        SessionReplaced(
                            session_id=self.session_id, attachment_generation=self.generation
                        )
                    )
                    return
                if data == CATCH_UP:
                    await self._replay(until_seq=None)
                continue
            event = orjson.loads(data)
            if event.get("type") == "session.created":
                continue  # the open already delivered it (possibly from the session hash)
            seq = event.get("server_event_seq")
            if seq is not None:
                if seq <= self.last_seq:
                    continue  # already replayed or delivered
                if seq > self.last_seq + 1 and not await self._replay(until_seq=seq - 1):
                    self._send_event(
                        SessionResyncRequired(session_id=self.session_id, reason="journal_gap")
                    )
                    return
                self.last_seq = seq
            self._enqueue_raw(data, event)

    def _enqueue_raw(self, data: bytes, event: dict[str, Any]) -> None:
        wire_type = event.get("type", "")
        if wire_type in ("session.updated", "session.created"):
            self._observe_session(event.get("session"))
        if wire_type in ("session.closed", "session.expired"):
            self.closed = True
        elif wire_type == "error":  # the worker's errors count with the pod's own
            self.pod.metrics.errors.labels(event.get("error", {}).get("code") or "unknown").inc()
        accepted = self.queue.put(OutItem(data, wire_type, event.get("response_id")))
        self.pod.metrics.events.inc()
        if not accepted and self.queue.overflowed and not self._overflow_handled:
            self._overflow_handled = True
            self._error("output_overflow", "the client reads too slowly; the session is closed")
            asyncio.get_running_loop().create_task(
                self._xadd(
                    self.worker_id,
                    InboxMessage(
                        CLOSE, self.session_id, self.generation, 0, {"reason": "output_overflow"}
                    ),
                )
            )

    def _observe_session(self, session: Any) -> None:
        if isinstance(session, dict):
            with contextlib.suppress(RealtimeProtocolError):
                self.defaults = InputAudioDefaults().updated(session)
            timeout = session.get("idle_timeout_s")
            if isinstance(timeout, int | float) and timeout > 0:
                self.idle_timeout_s = float(timeout)

    def _send_event(self, event: DuplexEvent) -> None:
        if isinstance(event, DuplexErrorEvent):
            self.pod.metrics.errors.labels(event.code or "unknown").inc()
        self.queue.put(OutItem(event.to_json(), event.wire_type))

    def _error(self, code: str, message: str, event_id: str | None = None, **extra: Any) -> None:
        self._send_event(
            DuplexErrorEvent.for_code(code, message, related_event_id=event_id, **extra)
        )

    async def _writer(self) -> None:
        try:
            while True:
                item = await self.queue.get()
                await self.ws.send_text(item.data.decode())
                if item.wire_type == "session.created":
                    self.created_sent = True
                if item.wire_type in CLOSURE_TYPES:
                    reason = (
                        "session_replaced"
                        if item.wire_type == "session.replaced"
                        else item.wire_type
                    )
                    await self.ws.close(1000, reason)
                    return
        except Exception:
            return  # the socket is gone: the reader sees the disconnect

    # ------------------------------------------------------------ end of the connection

    async def _release(self) -> None:
        pod, sid = self.pod, self.session_id
        if sid is None:
            return
        pod.liveness.release(sid, self.generation)
        with contextlib.suppress(Exception):
            await pod.hub.unsubscribe(pod.keys.live(sid), self._on_live)
            await pod.client.srem(pod.keys.api_sessions(pod.settings.pod_id), sid)
        if self.replaced or self.closed:
            return
        try:
            if self.opened_here and not self.created_sent:
                await self._xadd(
                    self.worker_id,
                    InboxMessage(
                        CLOSE, sid, self.generation, 0, {"reason": "session_created_undelivered"}
                    ),
                )
            elif self.resumable:
                grace_ms = int(pod.settings.disconnect_grace_s * 1000)
                await pod.store.detach(
                    sid, self.generation, grace_ms
                )  # fenced: a newer attachment wins
            else:
                await self._xadd(
                    self.worker_id,
                    InboxMessage(CLOSE, sid, self.generation, 0, {"reason": "disconnect"}),
                )
        except Exception:
            log.exception("releasing session %s failed", sid)
