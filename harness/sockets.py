"""Raw TCP clients for the servers' connection limits (tests and bench/exhaustion.py)."""

from __future__ import annotations

import asyncio
import contextlib

#: "the server closes it": only a broken deadline gets anywhere near this
EOF_WITHIN_S = 30.0


async def closed_by_server(reader: asyncio.StreamReader, within_s: float = EOF_WITHIN_S) -> bytes:
    """Everything the server sent, once it closed the connection (TimeoutError when it
    kept it open for `within_s`)."""
    received = b""
    async with asyncio.timeout(within_s):
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(65536):
                received += chunk
    return received
