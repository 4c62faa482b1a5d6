"""The API pod's WebSocket protocol: uvicorn's sans-I/O websockets protocol, lighter at rest.

uvicorn keeps, for the whole life of every socket, what it only needs for a moment:

- the handshake's `Request` and `Response` (their header tables, about 3 KiB a socket):
  the request's is never read again once `handle_connect` has built the ASGI scope, the
  response's once the 101 (or a refusal) has been sent;
- an asyncio.Queue for received messages and an asyncio.Event for write backpressure,
  which allocate five deques up front (about 3.8 KiB): `Mailbox` and `Flag`
  (services/api/waitables.py) only allocate while something is queued or waits.

On a pod of idle sessions these were a fifth of its memory per session
(docs/benchmarks.md, memory). Nothing else changes: same frames, same limits (uvicorn's
`ws_max_size`, 16 MiB, still bounds a message: large appends need it).

`GuardedH11Protocol` (services/api/http_guard.py) upgrades to this class whenever uvicorn
is configured with `ws="websockets-sansio"`. Written against uvicorn 0.55's
`protocols/websockets/websockets_sansio_impl.py`: it relies on `queue` (put_nowait, get,
empty), `writable` (set, clear, wait), `request`, `response`, `handle_connect` and `send`.
tests/api/test_ws_protocol.py checks both the drop and the behaviour end to end.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from services.api.waitables import Flag, Mailbox


class LeanWebSocketProtocol(WebSocketsSansIOProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # replaced at once: the asyncio ones built by uvicorn's constructor are freed here
        self.queue = Mailbox()  # type: ignore[assignment]
        self.writable = Flag(True)  # type: ignore[assignment]

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        # The scope holds what the app reads of the request (path, query, headers). The
        # request itself stays referenced by websockets' parser (a generator suspended
        # for the socket's life), so its header table is emptied, not just let go.
        event.headers.clear()
        self.request = None

    async def send(self, message: Any) -> None:
        await super().send(message)
        if self.handshake_complete:
            # the 101 (or the refusal) is on the wire: its header table is never read again
            self.response = None
