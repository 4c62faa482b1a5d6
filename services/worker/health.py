"""The worker's probe endpoints: GET /health (alive) and GET /health/ready (serving).

A worker has no other HTTP surface, so this is a minimal HTTP/1.1 responder
on its own port (DUPLEX_WORKER_HEALTH_PORT), not a web framework.
Ready means: the model plugin is loaded and warm, and the last heartbeat
reached Redis (the API pods can see this worker).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import orjson


class HealthServer:
    def __init__(
        self, port: int, ready: Callable[[], tuple[bool, str]], host: str = "0.0.0.0"
    ) -> None:
        self.port = port
        self.host = host
        self.ready = ready
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                request_line = await reader.readline()
                while (await reader.readline()).strip():
                    pass  # headers: not needed
            parts = request_line.decode("latin-1").split()
            path = parts[1] if len(parts) > 1 else ""
            if path == "/health":
                status, body = 200, {"status": "ok"}
            elif path == "/health/ready":
                ok, reason = self.ready()
                status, body = (200 if ok else 503), {"ready": ok, "reason": reason}
            else:
                status, body = 404, {"error": "not found"}
            payload = orjson.dumps(body)
            reason_phrase = {200: "OK", 503: "Service Unavailable", 404: "Not Found"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason_phrase}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
