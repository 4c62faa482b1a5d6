"""The worker's probe endpoints: GET /health (alive), GET /health/ready (serving) and
GET /metrics (Prometheus text, once a registry is handed over).

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
from prometheus_client import CollectorRegistry, generate_latest

#: a probe sends one short request; anything slower or longer is not a probe
REQUEST_TIMEOUT_S = 5.0
JSON = "application/json"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
REASONS = {200: "OK", 503: "Service Unavailable", 404: "Not Found"}


class HealthServer:
    def __init__(
        self,
        port: int,
        ready: Callable[[], tuple[bool, str]],
        host: str = "0.0.0.0",
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.port = port
        self.host = host
        self.ready = ready
        #: rendered on GET /metrics; whoever runs the process may set it before start()
        #: (services/serve.py hands over the worker's WorkerMetrics registry)
        self.registry = registry
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _answer(self, path: str) -> tuple[int, str, bytes]:
        if path == "/health":
            return 200, JSON, orjson.dumps({"status": "ok"})
        if path == "/health/ready":
            ok, reason = self.ready()
            return (200 if ok else 503), JSON, orjson.dumps({"ready": ok, "reason": reason})
        if path == "/metrics" and self.registry is not None:
            return 200, PROMETHEUS_TEXT, generate_latest(self.registry)
        return 404, JSON, orjson.dumps({"error": "not found"})

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                request_line = await reader.readline()
                while (await reader.readline()).strip():
                    pass  # headers: not needed
            parts = request_line.decode("latin-1").split()
            status, content_type, payload = self._answer(parts[1] if len(parts) > 1 else "")
            writer.write(
                f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, ValueError):
            pass  # ValueError: a line past the reader's 64 KiB limit
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
