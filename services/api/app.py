"""The API pod's routes: the Realtime WebSocket, models, health, chat, metrics, console.

Stateless: everything that outlives a socket is in Redis. The pod's collaborators are
built and wired in `services/api/pod.py`; here they are only put behind routes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from services.api.chat import openai_error
from services.api.door import bearer, offered_subprotocols
from services.api.pod import ApiPod
from services.api.realtime import REALTIME_PATHS, websocket_path
from services.api.security import SecurityHeaders
from services.api.socket_driver import SocketEndpoint
from shared.redis.connection import RedisHandle, connect
from shared.settings import ApiSettings

log = logging.getLogger(__name__)

CONSOLE_DIR = Path(__file__).with_name("console")


class DuplexApp(FastAPI):
    """FastAPI, with the Realtime WebSockets served at its door.

    A socket's ASGI call lasts as long as the socket, and so does every coroutine frame
    on the way to its handler. Through FastAPI's middleware stack, router and route that
    was about 10 KiB per idle session (three AsyncExitStacks alone, each an empty 760-byte
    deque, were 2.3 KiB; docs/benchmarks.md, memory). None of it applies to these sockets:
    the error and security middleware pass WebSockets through untouched, the routes have
    no dependencies, and the endpoint handles its own failures. The routes stay
    registered, so the app lists them (and serves them should this door be bypassed)."""

    #: every protocol's route (`ApiPod.socket_endpoints`), asked in turn for a socket's path
    socket_endpoints: Sequence[SocketEndpoint] = ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = websocket_path(scope)
        if path is not None:
            offered: list[str] | None = None  # read only where a route is named by one
            for endpoint in self.socket_endpoints:
                if endpoint.subprotocol is not None:
                    if offered is None:
                        offered = offered_subprotocols(Headers(scope=scope))
                    if endpoint.subprotocol not in offered:
                        continue
                if (args := endpoint.match(path)) is not None:
                    await endpoint(WebSocket(scope, receive, send), *args)
                    return
        await super().__call__(scope, receive, send)


def create_app(settings: ApiSettings, redis: RedisHandle | None = None) -> DuplexApp:
    handle = redis or connect(settings.redis_url)
    pod = ApiPod(settings, handle)
    authorized, pod_metrics, realtime, chat_completions = (
        pod.authorized,
        pod.metrics,
        pod.realtime,
        pod.chat,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pod.start()
        log.info(
            "API pod %s on %s:%d, Redis: %s",
            settings.pod_id,
            settings.host,
            settings.port,
            handle.description,
        )
        try:
            yield
        finally:
            await pod.stop()

    # No /openapi.json: the routes are OpenAI's (docs/wire-api.md), and a public schema
    # only maps the surface for a scanner; /docs and /redoc were never served.
    app = DuplexApp(
        title="duplex-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.pod = pod
    app.socket_endpoints = pod.socket_endpoints
    app.add_middleware(SecurityHeaders)

    def http_key(request: Request) -> str | None:
        return bearer(request.headers.get("authorization")) or request.query_params.get("api_key")

    def realtime_handler(force_duplex: bool) -> Callable[[WebSocket], Awaitable[None]]:
        async def route(websocket: WebSocket) -> None:
            await realtime(websocket, force_duplex=force_duplex)

        return route

    # listed among the app's routes; DuplexApp serves these paths before the router
    for path, force_duplex in REALTIME_PATHS.items():
        app.add_api_websocket_route(path, realtime_handler(force_duplex))

    # the browser console (docs/console.md): static files, no build step; public like
    # /health (everything it does goes through /v1, which checks API keys)
    app.mount("/console", StaticFiles(directory=CONSOLE_DIR), name="console")

    @app.get("/", include_in_schema=False)
    async def console_page() -> FileResponse:
        return FileResponse(CONSOLE_DIR / "index.html")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        ok, reason = await pod.ready()
        return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not authorized(http_key(request)):
            return openai_error(401, "invalid or missing API key", "invalid_api_key")
        return PlainTextResponse(pod_metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not authorized(http_key(request)):
            return openai_error(401, "invalid or missing API key", "invalid_api_key")
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "duplex-serve"}
            for m in await pod.models()
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        if not authorized(http_key(request)):
            return openai_error(401, "invalid or missing API key", "invalid_api_key")
        return await chat_completions(request)

    return app
