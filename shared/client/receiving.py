"""What every client does with its received events, written once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from shared.protocol.duplex import DuplexEvent

Receive = Callable[[float], Awaitable[DuplexEvent]]


async def receive_until(recv: Receive, wire_type: str, timeout: float) -> list[DuplexEvent]:
    """Every event up to and including the first of `wire_type`, within `timeout` in all."""
    out: list[DuplexEvent] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        event = await recv(max(0.0, deadline - loop.time()))
        out.append(event)
        if event.wire_type == wire_type:
            return out
