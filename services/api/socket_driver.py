"""`SocketDriver`: one client socket and its session, whatever the protocol.

Every protocol's socket does the same around what it says: a writer task sends what the
session's `Delivery` queues, the delivery pump (`Delivery.pump`) brings the session's
events in, a reader hands the client's messages to the session, and at the end the
attachment is released (`Attachment.release`) and the socket is closed once what was
queued has gone out. That is written here, once; a protocol is a subclass that says only
what is its own (docs/architecture.md, "Where to add X"):

- `open(writer)`: the session, opened or resumed (after the upgrade; Moshi's is opened at
  its door, before it); False once the client was refused (and told);
- `ready(writer)`: the session may be spoken to (a native protocol waits for its model to
  step its prompt: `wait_ready`); False once it cannot be, or the close to send;
- `on_message(message)`: one client message (decoded, refused, or commands for the
  session, sent with `command`); returns a close to send when the protocol ends the
  socket itself;
- `send_item(item)`: one of the session's queued events as the protocol's frames; False
  once the socket is closed after it;
- `refuse(event)`: a refusal in the protocol's words (an `error` event, or a log line for
  a protocol that has none);
- `failed()`: what the client hears when the server failed on its socket.

The three tasks are never restarted (a restarted writer or pump would send out of order or
after a takeover); a message read while the session was getting ready is kept for the
reader (`early`, bounded by `keep_early`: the first `max_early`).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, ClassVar

from redis.exceptions import RedisError
from starlette.websockets import WebSocket, WebSocketDisconnect

from services.api.attachment import AttachFailed, Attachment, AttachmentStateError
from services.api.command_sender import failure_event
from services.api.delivery import Delivery, SessionParts
from services.api.inbox_writer import InboxFull
from services.api.metrics import ApiMetrics
from services.api.output_queue import OutItem
from shared.protocol.duplex import DuplexCommand, DuplexErrorEvent

log = logging.getLogger(__name__)

#: a WebSocket message as the ASGI server gives it
Message = dict[str, Any]
#: a close the protocol sends itself: (RFC 6455 code, reason)
Close = tuple[int, str]
#: builds an unattached session's parts for a client's key (`ApiPod.session_parts`)
PartsFactory = Callable[[str | None], SessionParts]
#: how long the end of a socket waits for what was queued to go out
DRAIN_S = 5.0


class SocketEndpoint(abc.ABC):
    """A WebSocket route of the pod: which paths are its (`match`), and what serves a socket
    there (`__call__`: the door, the upgrade, the connection). The pod lists one per
    protocol (`ApiPod.socket_endpoints`); the app asks each in turn for a socket's path."""

    #: the WebSocket subprotocol that names this route's protocol on a path another route
    #: shares (MAP Realtime's `map.realtime` on `/v1/realtime`): the endpoint is asked only
    #: for a socket that offers it, and is listed before the route it shares the path with
    subprotocol: ClassVar[str | None] = None

    @abc.abstractmethod
    def match(self, path: str) -> tuple[Any, ...] | None:
        """The arguments `__call__` takes after the socket for a socket on `path` (below
        the root path); None when the path is not this route's."""

    @abc.abstractmethod
    async def __call__(self, websocket: WebSocket, *args: Any) -> None:
        """Serve one socket, from before its upgrade to its end."""


class HandshakeFailed(Exception):
    """The socket could not open or resume a session; the client was told why."""


async def next_message(
    websocket: WebSocket, *ends: asyncio.Future[Any], timeout: float | None = None
) -> Message | None:
    """The socket's next message, or None when one of `ends` finished first (or `timeout`
    passed): a reader that waits on the client alone would miss its session's end."""
    receive = asyncio.ensure_future(websocket.receive())
    try:
        await asyncio.wait((receive, *ends), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not receive.done():
            receive.cancel()  # nothing taken: the socket's queue gives it to the next read
    return receive.result() if receive.done() and not receive.cancelled() else None


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


class SocketDriver(abc.ABC):
    #: the task names' prefix, and the logs'
    protocol: str = "ws"
    #: client messages kept while the session gets ready (a bound, not a buffer)
    max_early: int = 0

    def __init__(
        self,
        websocket: WebSocket,
        attachment: Attachment,
        delivery: Delivery,
        metrics: ApiMetrics,
    ) -> None:
        self.ws = websocket
        self.attachment = attachment
        self.delivery = delivery
        self.metrics = metrics
        # an append is not awaited (services/api/command_sender.py): its failure reaches
        # the client as the protocol says a refusal, as the reader's own do
        attachment.commands.report = self.refuse
        #: client messages read while the session got ready, for the reader
        self.early: collections.deque[Message] = collections.deque()

    # ------------------------------------------------------------ the protocol's part

    @abc.abstractmethod
    async def open(self, writer: asyncio.Task[None]) -> bool:
        """Open or resume the session; False once the client was refused (and told)."""

    async def ready(self, writer: asyncio.Task[None]) -> bool | Close:
        """Until the session may be spoken to (True); False once it cannot be (the client
        was told), or the close to send. At once, unless the protocol waits for its model
        (`wait_ready`)."""
        return True

    @abc.abstractmethod
    async def on_message(self, message: Message) -> Close | None:
        """One client message (never a disconnect); a close when the protocol ends the
        socket itself."""

    @abc.abstractmethod
    async def send_item(self, item: OutItem) -> bool:
        """One queued event to the client; False once the socket is closed after it."""

    @abc.abstractmethod
    def refuse(self, event: DuplexErrorEvent) -> None:
        """A refusal (a command not delivered, a frame not taken) in the protocol's words."""

    @abc.abstractmethod
    def failed(self) -> Close | None:
        """The server failed on this socket (a bug, logged): what the client is told, and
        the close to send, if the protocol sends one itself."""

    @property
    def idle_timeout_s(self) -> float | None:
        """A socket silent this long is a disconnect (None: no limit)."""
        return None

    async def next_item(self) -> OutItem:
        """The next event to send (a protocol may send something of its own meanwhile)."""
        return await self.delivery.get()

    def keep_early(self, message: Message) -> bool:
        """Whether a client message read while the session got ready is kept for the
        reader (`wait_ready`): the first `max_early`. A protocol may bound them its own way
        (by size too), or say that it dropped one."""
        return len(self.early) < self.max_early

    # ------------------------------------------------------------ the socket's life

    async def run(self) -> None:
        # named tasks, not supervised loops: they end with the socket, never restart
        writer = asyncio.create_task(self._write_loop(), name=f"{self.protocol}-writer")
        pump: asyncio.Task[None] | None = None
        reader: asyncio.Task[Close | None] | None = None
        close: Close | None = None
        try:
            if await self.open(writer) and self.attachment.session_id is not None:
                pump = asyncio.create_task(
                    self.delivery.pump(), name=f"{self.protocol}-live:{self.attachment.session_id}"
                )
                ready = await self.ready(writer)
                if ready is True:
                    reader = asyncio.create_task(self._read_loop(), name=f"{self.protocol}-reader")
                    close = await self._read_until_the_end(reader, writer)
                elif ready is not False:
                    close = ready
        except (HandshakeFailed, WebSocketDisconnect):
            pass
        except Exception:
            log.exception("%s connection of %s failed", self.protocol, self.attachment.session_id)
            close = self.failed()
        finally:
            for task in (reader, pump):
                if task is not None:
                    task.cancel()
            await self.attachment.release()
            await self._finish(writer, close)

    async def _finish(self, writer: asyncio.Task[None], close: Close | None) -> None:
        """The socket closes: with the protocol's own close at once (what is queued is
        not for a socket it ends), else once the writer has sent what was queued."""
        if close is not None:
            writer.cancel()
            with contextlib.suppress(Exception):
                await self.ws.close(*close)
            return
        if not writer.done():
            with contextlib.suppress(TimeoutError, Exception):
                async with asyncio.timeout(DRAIN_S):
                    await self.delivery.drained()  # the writer has taken everything queued
                    await self.ws.close(1000)
            writer.cancel()
        elif not writer.cancelled() and (exc := writer.exception()) is not None:
            log.error("the writer of session %s failed", self.attachment.session_id, exc_info=exc)

    @staticmethod
    async def _read_until_the_end(
        reader: asyncio.Task[Close | None], writer: asyncio.Task[None]
    ) -> Close | None:
        """The reader's close, or None once the session ended first (the writer closed the
        socket after its closure: the reader, waiting on the client, is stopped). One wait
        for the socket's life, not one per message (a task per message was most of a JSON
        append's cost on the pod)."""
        await asyncio.wait((reader, writer), return_when=asyncio.FIRST_COMPLETED)
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            return None
        return reader.result()

    async def _read_loop(self) -> Close | None:
        """Until the client leaves or falls silent; the close to send, if the protocol
        ends the socket itself."""
        while True:
            if self.early:
                message = self.early.popleft()
            else:
                try:
                    async with asyncio.timeout(self.idle_timeout_s):
                        message = await self.ws.receive()
                except TimeoutError:
                    return None  # an idle socket is a disconnect
            if message["type"] == "websocket.disconnect":
                return None
            try:
                close = await self.on_message(message)
            except RedisError as exc:
                # a message whose handling needs Redis while it is failing over (an ack,
                # a command awaited): the client is told (retryable) and the socket lives,
                # as for a command the inbox writer could not write
                log.debug("a message of %s not handled: %s", self.attachment.session_id, exc)
                self.refuse(failure_event(exc, None))
                continue
            if close is not None:
                return close

    async def _write_loop(self) -> None:
        try:
            # the item lives in `send_item`'s frame only: nothing holds the last one sent
            # while the writer waits (an idle socket kept its session.created, whose JSON
            # orjson leaves in a 16 KiB buffer: most of an idle session's memory)
            while await self.send_item(await self.next_item()):
                pass
        except AttachmentStateError:
            raise  # a bug, not a gone socket: `_finish` logs it
        except Exception:
            return  # the socket is gone: the reader sees the disconnect

    # ------------------------------------------------------------ helpers for protocols

    async def receive(self, timeout: float | None = None) -> Message | None:
        """The client's next message (None: `timeout` passed); a disconnect raises."""
        try:
            async with asyncio.timeout(timeout):
                message = await self.ws.receive()
        except TimeoutError:
            return None
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        return message

    async def wait_ready(
        self, ready: asyncio.Event, writer: asyncio.Task[None], timeout_s: float
    ) -> str:
        """Until `ready` is set ("ready"), the session ended first ("ended": the writer
        closed the socket after its closure), or `timeout_s` passed ("timeout"). The socket
        is read meanwhile, so that a client that leaves (WebSocketDisconnect) frees its
        slot at once; what it sends is kept for the reader as `keep_early` says (the first
        `max_early` messages), and so is the one read as `ready` was set, which may have
        been sent after it."""
        waiting = asyncio.create_task(ready.wait())
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 and not waiting.done():
                    return "timeout"
                message = await next_message(self.ws, waiting, writer, timeout=max(remaining, 0))
                if message is not None and message["type"] == "websocket.disconnect":
                    raise WebSocketDisconnect(message.get("code", 1000))
                if waiting.done():
                    if message is not None:
                        self.early.append(message)
                    return "ready"
                if message is not None and self.keep_early(message):
                    self.early.append(message)
                if writer.done():
                    return "ended"
        finally:
            waiting.cancel()

    async def command(self, command: DuplexCommand, event_id: str | None) -> bool:
        """A command to the session; False once its refusal was said (`refuse`): the
        worker's inbox is full, or Redis is unreachable (the socket lives on)."""
        try:
            await self.attachment.command(command)
        except (InboxFull, RedisError) as exc:
            if isinstance(exc, RedisError):
                # said once a run for the pod by its inbox writer (`OutageLog`); the client
                # hears its refusal
                log.debug("command for %s not delivered: %s", self.attachment.session_id, exc)
            self.refuse(failure_event(exc, event_id))
            return False
        return True
