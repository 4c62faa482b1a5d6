"""The API pod's HTTP/1.1 protocol: uvicorn's h11 protocol with two guards it lacks.

1. A deadline for request heads. uvicorn closes a kept-alive connection that stays
   silent for `timeout_keep_alive`, but a fresh connection that sends nothing, or
   half a request line, or one header byte a second, stays open for ever (issue 14:
   300 such sockets exhausted a 256-descriptor limit and locked out /health). Here a
   connection that is waiting for a request head gets `header_timeout_s` to send a
   whole one, or it is closed. The same deadline bounds the draining of a body the
   app refused early (a 413 before the body was read): uvicorn reads and discards
   the rest, which an endless chunked body would stretch for ever.
2. `limit_concurrency` for WebSocket upgrades. uvicorn answers 503 to a plain
   request past the limit but upgrades every WebSocket regardless; here an upgrade
   past the limit gets the same 503 instead of a session.
3. The probes past `limit_concurrency`: `GET /health` and `/health/ready` are always
   served. A pod full of sessions (or of sockets waiting out the head deadline) must
   not fail its liveness probe and be restarted, which would drop every session on it.

It also upgrades WebSockets to `LeanWebSocketProtocol` (services/api/ws_protocol.py)
when uvicorn is configured with its sans-I/O websockets protocol: the same protocol,
without the handshake's headers and idle queues held for the socket's whole life.

Written against uvicorn 0.55's `protocols/http/h11_impl.py`: it relies on
`connection_made`, `data_received`, `on_response_complete`, `connection_lost`,
`handle_websocket_upgrade`, `self.conn` (the h11.Connection), `self.connections`,
`self.tasks` and `self.ws_protocol_class`. tests/e2e/test_hostile_http.py checks the
behaviour end to end.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState

from services.api.ws_protocol import LeanWebSocketProtocol

log = logging.getLogger(__name__)


#: answered whatever the connection count (the chart's liveness and readiness probes)
PROBE_PATHS = frozenset({"/health", "/health/ready"})


class GuardedH11Protocol(H11Protocol):
    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        header_timeout_s: float,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        if self.ws_protocol_class is WebSocketsSansIOProtocol:
            self.ws_protocol_class = LeanWebSocketProtocol  # less memory per idle socket
        self.header_timeout_s = header_timeout_s
        self._deadline: asyncio.TimerHandle | None = None

    @property  # type: ignore[override]
    def limit_concurrency(self) -> int | None:
        """uvicorn reads this right after it has built the request's scope: a probe's
        request sees no limit."""
        scope = getattr(self, "scope", None)
        if scope is not None and scope.get("type") == "http" and scope.get("path") in PROBE_PATHS:
            return None
        return self._limit_concurrency

    @limit_concurrency.setter
    def limit_concurrency(self, value: int | None) -> None:
        self._limit_concurrency = value

    # ------------------------------------------------------------ the head deadline

    def _waiting_for_client(self) -> bool:
        """True while the next move is the client's alone: a request head to send, or
        the rest of a body the app already answered (and will never read)."""
        if self.transport.get_protocol() is not self:  # upgraded to a WebSocket
            return False
        theirs, ours = self.conn.their_state, self.conn.our_state
        answered = ours in (h11.DONE, h11.MUST_CLOSE)
        return theirs is h11.IDLE or (theirs is h11.SEND_BODY and answered)

    def _update_deadline(self) -> None:
        # Armed once per wait: bytes trickling in do not extend it (that is the point).
        waiting = self.transport is not None and self._waiting_for_client()
        if waiting and self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout_s, self._expire)
        elif not waiting and self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or not self._waiting_for_client():
            return
        log.debug("closing %s: no whole request within %.1f s", self.client, self.header_timeout_s)
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._update_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._update_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    # ------------------------------------------------------------ WebSocket upgrades

    def _over_limit(self) -> bool:
        limit = self._limit_concurrency
        return limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        if self._deadline is not None:  # the WebSocket protocol owns the socket from here
            self._deadline.cancel()
            self._deadline = None
        if not self._over_limit():
            super().handle_websocket_upgrade(event)
            return
        log.warning("Exceeded concurrency limit: WebSocket upgrade refused with 503.")
        body = b"Service Unavailable"
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        response = h11.Response(status_code=503, headers=headers, reason=b"Service Unavailable")
        self.transport.write(self.conn.send(response) or b"")
        self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
        self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        self.transport.close()
