"""The inline client: drive a session host in-process with typed commands, read typed events.

Used by tests, benchmarks and the all-in-one server. No socket, no Redis: the
same commands and events the wire carries, without the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from shared.client.receiving import receive_until
from shared.contracts import SessionEventSink, SessionHost
from shared.protocol.duplex import (
    SURFACE_DUPLEX,
    SURFACE_KEY,
    CloseSession,
    CommandContext,
    DuplexCommand,
    DuplexEvent,
    InputAudioDefaults,
    RealtimeProtocolError,
    SessionClosed,
    UpdateSession,
    parse_client_event,
)

DEFAULT_TIMEOUT_S = 10.0


class InlineEventRouter(SessionEventSink):
    """Routes each session's events to its own queue (created on first use)."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[DuplexEvent]] = {}

    def queue(self, session_id: str) -> asyncio.Queue[DuplexEvent]:
        return self._queues.setdefault(session_id, asyncio.Queue())

    def emit(self, session_id: str, event: DuplexEvent) -> None:
        self.queue(session_id).put_nowait(event)

    def forget(self, session_id: str) -> None:
        self._queues.pop(session_id, None)


class InlineSession:
    """One open session: `send` commands, `recv` events in emission order."""

    def __init__(
        self,
        host: SessionHost,
        router: InlineEventRouter,
        session_id: str,
        session: Mapping[str, Any],
    ):
        self.host = host
        self.router = router
        self.session_id = session_id
        self.session = dict(session)
        self._defaults = InputAudioDefaults().updated(self.session)
        self._events = router.queue(session_id)
        self.closed = False

    async def send(self, command: DuplexCommand | Mapping[str, Any] | str | bytes) -> None:
        """A typed command, or a client event as JSON or dict (read with the session's formats)."""
        if not isinstance(command, DuplexCommand):
            command = parse_client_event(command, CommandContext(self._defaults))
        if isinstance(command, UpdateSession):  # later appends use the new formats at once
            with contextlib.suppress(RealtimeProtocolError):
                self._defaults = self._defaults.updated(command.patch)
        await self.host.submit(self.session_id, command)

    async def recv(self, timeout: float = DEFAULT_TIMEOUT_S) -> DuplexEvent:
        async with asyncio.timeout(timeout):
            event = await self._events.get()
        if event.wire_type in ("session.updated", "session.created"):
            self.session = dict(event.session)  # type: ignore[attr-defined]
            self._defaults = InputAudioDefaults().updated(self.session)
        if isinstance(event, SessionClosed):
            self.closed = True
        return event

    def pending(self) -> list[DuplexEvent]:
        """Events already emitted and not yet received (without waiting)."""
        out = []
        while not self._events.empty():
            out.append(self._events.get_nowait())
        return out

    async def until(self, wire_type: str, timeout: float = DEFAULT_TIMEOUT_S) -> list[DuplexEvent]:
        """Every event up to and including the first of `wire_type`."""
        return await receive_until(self.recv, wire_type, timeout)

    async def events(self) -> AsyncIterator[DuplexEvent]:
        while not self.closed:
            yield await self.recv(timeout=None)  # type: ignore[arg-type]

    async def close(self, reason: str = "client_close") -> None:
        await self.host.submit(self.session_id, CloseSession(reason=reason))


class InlineDuplexClient:
    def __init__(self, host: SessionHost, router: InlineEventRouter) -> None:
        self.host = host
        self.router = router

    async def open(self, session: Mapping[str, Any] | None = None, **kwargs: Any) -> InlineSession:
        """Open a session and consume its opening events: `session.created`, and on the
        duplex surface the `session.updated` that follows it (the others have none)."""
        session = session or {}
        result = await self.host.open(session, **kwargs)
        inline = InlineSession(self.host, self.router, result.session_id, result.session)
        created = await inline.recv()
        if created.wire_type != "session.created":
            raise RuntimeError(f"expected session.created first, got {created.wire_type}")
        if (session.get(SURFACE_KEY) or SURFACE_DUPLEX) == SURFACE_DUPLEX:
            updated = await inline.recv()
            if updated.wire_type != "session.updated":
                raise RuntimeError(f"expected session.updated next, got {updated.wire_type}")
        return inline
