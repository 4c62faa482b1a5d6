"""The Realtime protocol's socket (OpenAI's GA API and our duplex surface) on the socket
driver (`socket_driver.py`: the writer, the delivery pump, the reader loop, the release).

The connection parses the client's JSON frames and hands each to its session; it sends
what its `Delivery` queues. It holds nothing that must outlive it: its `Attachment` is the
hold on the session (open, resume, release), its `Delivery` the events out (live pump,
replay, gap fill, overflow), and the session itself lives on its worker and in Redis.

The formats appends are parsed with are the worker's (`SessionView`): a session.update
that would change the input format is not applied here; the reader holds the next frames
until the worker has answered it (session.updated, or its refusal).

On the openai surface (plain /v1/realtime) the worker already emits OpenAI GA's events
(services/worker/engine/surface.py); here the client's duplex-only events are refused
(`unknown_event`), and a closure notice closes the socket without being sent (GA has no
such event). The events need no rewriting here: the worker publishes an openai-surface
session's JSON without `server_event_seq` (its seq travels in the live header only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.api.attachment import AttachFailed, Attachment
from services.api.delivery import Delivery, SessionView
from services.api.metrics import ApiMetrics
from services.api.output_queue import CLOSURE_TYPES, OutItem
from services.api.socket_driver import Close, HandshakeFailed, Message, SocketDriver
from shared.protocol.duplex import (
    CLIENT_COMMAND_TIERS,
    SURFACE_DUPLEX,
    SURFACE_KEY,
    SURFACE_OPENAI,
    AppendAudio,
    CloseSession,
    DuplexCommand,
    DuplexErrorEvent,
    RealtimeProtocolError,
    SessionEventAck,
    SessionResume,
    SessionResumed,
    SignalTurn,
    UpdateSession,
    parse_client_event,
)

log = logging.getLogger(__name__)


#: frames longer than this are parsed off the event loop (a 20 ms pcm16 append is ~1 KiB)
PARSE_INLINE_MAX_CHARS = 256 * 1024
#: what ends the socket on the openai surface, unsent: the closures and a lost journal
OPENAI_ENDINGS = CLOSURE_TYPES | {"session.resync_required"}
#: how long the reader holds the client's frames behind a session.update that changes the
#: input format, waiting for the worker's answer: a safety net (an answer is lost only with
#: its worker; a moved session's next worker answers the commands forwarded to it)
UPDATE_ANSWER_TIMEOUT_S = 10.0

#: what a client frame parses as: a session's command, or an envelope event of the
#: socket's own (`conversation.item.retrieve` comes as its SignalTurn, a command)
ClientFrame = DuplexCommand | SessionResume | SessionEventAck


def duplex_only(command: ClientFrame) -> bool:
    """A client event the OpenAI Realtime API does not have: a Tier 3 command, or an
    envelope event of ours (`conversation.item.retrieve`, which is GA's, comes as its
    SignalTurn and passes)."""
    if isinstance(command, SessionResume | SessionEventAck):
        return True
    if isinstance(command, SignalTurn) and command.event == "conversation.item.retrieve":
        return False
    return CLIENT_COMMAND_TIERS.get(command.wire_type) == 3


class RealtimeConnection(SocketDriver):
    protocol = "ws"
    update_answer_timeout_s = UPDATE_ANSWER_TIMEOUT_S

    def __init__(
        self,
        websocket: WebSocket,
        attachment: Attachment,
        delivery: Delivery,
        view: SessionView,
        metrics: ApiMetrics,
        *,
        model: str | None,
        autostart: bool,
        resume_only: bool,
        config_timeout_s: float,
        max_input_bytes: int,
    ):
        super().__init__(websocket, attachment, delivery, metrics)
        self.view = view
        self.model = model
        self.autostart = autostart and not resume_only
        self.resume_only = resume_only
        self.config_timeout_s = config_timeout_s
        self.max_input_bytes = max_input_bytes  # the session's pending-input limit
        self.surface = SURFACE_DUPLEX

    def use_surface(self, surface: str) -> None:
        """Serve the socket as `surface` (realtime.py: before `run`)."""
        self.surface = surface
        self.attachment.serve_surface(surface)

    @property
    def openai(self) -> bool:
        return self.surface == SURFACE_OPENAI

    # ------------------------------------------------------------ the driver's hooks

    async def open(self, writer: asyncio.Task[None]) -> bool:
        first = await self._handshake()
        if first is not None:  # the first frame, not an opening one: the reader's first
            self.early.append({"type": "websocket.receive", "text": first})
        return True

    @property
    def idle_timeout_s(self) -> float:
        return self.view.idle_timeout_s

    async def on_message(self, message: Message) -> Close | None:
        text = message.get("text")
        if text is None:
            self.delivery.error(
                "bad_event", "binary frames are not supported: send JSON text frames"
            )
            return None
        await self._handle_frame(text)
        return None

    def refuse(self, event: DuplexErrorEvent) -> None:
        self.delivery.send(event)

    def failed(self) -> Close | None:
        self.delivery.error(
            "internal_error", "the server failed on this connection; resume or reconnect"
        )
        return None

    # ------------------------------------------------------------ handshake

    async def _handshake(self) -> str | None:
        """Open or resume. Returns a first frame still to be handled as a command."""
        if self.autostart and self.model:
            await self._open({"model": self.model})
            return None
        deadline = time.monotonic() + self.config_timeout_s
        while True:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    frame = await self._receive_text()
            except TimeoutError:
                self.delivery.error(
                    "config_timeout",
                    "no session.update or session.resume within the config timeout",
                )
                raise HandshakeFailed from None
            try:
                event = await self._parse(frame)
            except RealtimeProtocolError as exc:
                self.delivery.send(DuplexErrorEvent.from_exception(exc))
                continue
            if isinstance(event, SessionResume) and self.openai:
                self._refuse_duplex_only(event)
                continue
            if isinstance(event, SessionResume):
                await self._resume(event)
                return None
            if isinstance(event, UpdateSession):
                await self._open(event.patch)
                return None
            if self.resume_only:
                self.delivery.error(
                    "invalid_session_config",
                    "the first message must be session.update or session.resume",
                    event.event_id,
                )
                continue
            await self._open({"model": self.model} if self.model else {})
            return frame

    async def _open(self, session: dict[str, Any]) -> None:
        # the surface is the route's, told to the worker at open: a client's own is dropped
        session = {k: v for k, v in session.items() if k != SURFACE_KEY}
        if self.openai:
            session[SURFACE_KEY] = SURFACE_OPENAI
        try:
            reply = await self.attachment.open(session, self.model)
        except AttachFailed as failed:
            self._refused(failed)
            raise HandshakeFailed from None
        self.delivery.created(reply)
        self.metrics.sessions_opened.inc()

    async def _resume(self, request: SessionResume) -> None:
        try:
            resumed = await self.attachment.resume(request)
        except AttachFailed as failed:
            self._refused(failed)
            raise HandshakeFailed from None
        self.view.observe(resumed.session)
        self.delivery.send(
            SessionResumed(
                session_id=request.session_id,
                session=resumed.session,
                attachment_generation=self.attachment.generation,
                resume_token=resumed.resume_token,
            )
        )
        await self.delivery.resume_after(request.last_received_server_event_seq)
        await self.attachment.touch()
        self.metrics.resumes.inc()

    def _refused(self, failed: AttachFailed) -> None:
        if failed.event is not None:
            self.delivery.send(failed.event)
        elif failed.reply is not None:  # the worker's own error, as it sent it
            self.delivery.enqueue(orjson.dumps(failed.reply), failed.reply)

    # ------------------------------------------------------------ client -> worker

    async def _receive_text(self) -> str:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            if message.get("text") is not None:
                return message["text"]
            self.delivery.error(
                "bad_event", "binary frames are not supported: send JSON text frames"
            )

    async def _parse(self, frame: str) -> ClientFrame:
        """A client frame as a command. A large one is parsed on a thread: JSON and base64
        cost about 5 ms per MiB, and a 10 MiB append parsed here held every socket of the
        pod for 40-75 ms (bench/exhaustion.py, inbox_flood). The GIL still makes the loop
        wait for parts of it (20-70 ms). Frames are still handled one at a time, in
        order: the caller awaits this."""
        if len(frame) <= PARSE_INLINE_MAX_CHARS:
            return parse_client_event(frame, self.view.context)
        return await asyncio.to_thread(parse_client_event, frame, self.view.context)

    async def _handle_frame(self, frame: str) -> None:
        if not self.attachment.live:
            return  # a superseded socket's input is ignored
        try:
            command = await self._parse(frame)
        except RealtimeProtocolError as exc:
            self.delivery.send(DuplexErrorEvent.from_exception(exc))
            return
        if not self.attachment.live:
            return  # taken over (or ended) while a large frame was parsed on a thread
        if self.openai and duplex_only(command):
            self._refuse_duplex_only(command)
            return
        if isinstance(command, SessionResume):
            self.delivery.error(
                "unsupported_session_resume",
                "session.resume is only valid as the first message",
                command.event_id,
            )
            return
        if isinstance(command, AppendAudio) and not self._fits_input_budget(command):
            return
        await self._deliver(command)

    def _refuse_duplex_only(self, command: ClientFrame) -> None:
        self.delivery.error(
            "unknown_event",
            f"{command.wire_type} is not an OpenAI Realtime event; "
            "connect with ?duplex=1 for the duplex protocol",
            command.event_id,
            param="type",
        )

    def _fits_input_budget(self, command: AppendAudio) -> bool:
        """Refuse at the door an append that alone is over the session's pending-input
        limit: the worker would refuse it anyway, after it had crossed Redis."""
        limit = self.max_input_bytes
        if len(command.audio) <= limit:
            return True
        self.delivery.error(
            "input_backpressure",
            f"an append of {len(command.audio)} audio bytes is over the session's pending "
            f"input limit of {limit} bytes; send smaller appends",
            command.event_id,
        )
        return False

    async def _deliver(self, command: DuplexCommand | SessionEventAck) -> None:
        """A command to its session. A session.update that would change the input format
        returns once the worker has answered it (`SessionView`): the appends after it are
        parsed with the format the worker decided, the refused update's or not."""
        if isinstance(command, SessionEventAck):
            if not await self.attachment.acknowledge(command.server_event_seq):
                self.delivery.error(
                    "invalid_event_ack",
                    "server_event_seq is past the newest event",
                    command.event_id,
                )
            return
        awaits_answer = False
        if isinstance(command, UpdateSession):
            if isinstance(command.patch, dict):
                command.patch.pop(SURFACE_KEY, None)  # the surface is the pod's to say
            # not applied here: the worker may refuse it (SessionView)
            awaits_answer = self.view.expect(command.patch, command.event_id)
        started = time.perf_counter()
        delivered = False
        try:
            delivered = await self.command(command, command.event_id)
        finally:
            if awaits_answer and not delivered:
                self.view.settle()  # not written: the worker will not answer it
        if not delivered:
            return
        self.metrics.command_latency.observe(time.perf_counter() - started)
        if isinstance(command, CloseSession):
            self.metrics.sessions_closed.inc()
        if awaits_answer and not await self.view.answer(self.update_answer_timeout_s):
            log.warning(
                "session %s: no answer to a session.update within %.0f s; appends are parsed "
                "with the input format the worker last confirmed",
                self.attachment.session_id,
                self.update_answer_timeout_s,
            )

    # ------------------------------------------------------------ worker -> client

    async def send_item(self, item: OutItem) -> bool:
        """One queued item to the client; False once the socket is closed after it."""
        if self.openai and item.wire_type in OPENAI_ENDINGS:
            await self.ws.close(1000, item.wire_type)  # GA has no such event
            return False
        await self.ws.send_text(item.data.decode())
        if item.wire_type == "session.created":
            self.attachment.created_delivered()
        if item.wire_type in CLOSURE_TYPES:
            reason = "session_replaced" if item.wire_type == "session.replaced" else item.wire_type
            await self.ws.close(1000, reason)
            return False
        return True
