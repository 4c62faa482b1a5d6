"""The API pod: FastAPI app with the Realtime WebSocket, models, health, chat and metrics.

Stateless: everything that outlives a socket is in Redis. `ApiPod` holds the
pod-wide pieces (Redis client, scripts, the live hub, the worker directory,
metrics); `create_app` wires them into routes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

from services.api.chat import ChatCompletions, openai_error
from services.api.connection import RealtimeConnection
from services.api.inbox_writer import InboxWriter
from services.api.janitor import Janitor
from services.api.live import LiveHub
from services.api.liveness import PodLiveness
from services.api.metrics import ApiMetrics
from services.api.placement import WorkerDirectory
from services.api.security import KeyChecker, SecurityHeaders, origin_allowed
from shared.contracts import SessionRuntimeConfig
from shared.loop_lag import LoopLagMonitor
from shared.redis.connection import RedisHandle, connect
from shared.redis.keys import KeySchema
from shared.redis.store import SessionStore
from shared.settings import ApiSettings

log = logging.getLogger(__name__)

TRUE_VALUES = {"1", "true", "on", "yes"}
FALSE_VALUES = {"0", "false", "off", "no"}
#: browsers cannot set headers on a WebSocket: they send the key as this subprotocol
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
CONSOLE_DIR = Path(__file__).with_name("console")


class ApiPod:
    def __init__(
        self, settings: ApiSettings, redis: RedisHandle, runtime: SessionRuntimeConfig | None = None
    ):
        self.settings = settings
        self.redis = redis
        self.client = redis.client
        self.keys = KeySchema(settings.key_prefix)
        self.store = SessionStore(self.client, self.keys)
        self.runtime = runtime or SessionRuntimeConfig()
        self.directory = WorkerDirectory(
            self.client, self.keys, settings.heartbeat_ttl_s, settings.placement_epsilon
        )
        self.hub = LiveHub(redis.pubsub_client(), self.keys.api(settings.pod_id))
        self.metrics = ApiMetrics()
        self.janitor = Janitor(self)
        self.authorized = KeyChecker(settings.api_keys)
        self.loop_lag = LoopLagMonitor(
            f"API pod {settings.pod_id}", self.metrics.loop_lag, settings.loop_lag_warn_s
        )
        self._ready_detail: str | None = None  # the last failure ready() logged
        self.inbox_writer = InboxWriter(self.client, self.keys, self.store.scripts)
        self.liveness = PodLiveness(
            self.client,
            self.keys,
            self.store,
            settings.pod_id,
            settings.heartbeat_interval_s,
            settings.heartbeat_ttl_s,
        )

    async def start(self) -> None:
        await self.store.scripts.ensure_loaded(self.client)
        await self.hub.start()
        await self.liveness.start()
        await self.janitor.start()
        self.loop_lag.start()

    async def stop(self) -> None:
        await self.loop_lag.stop()
        await self.janitor.stop()
        await self.liveness.stop()
        await self.hub.stop()
        await self.inbox_writer.stop()
        with contextlib.suppress(Exception):
            await self.client.zrem(self.keys.apis(), self.settings.pod_id)

    async def ready(self) -> tuple[bool, str]:
        """(ready, reason) for GET /health/ready. The reason is public (probes carry no
        key): it never names the Redis host, port or error; the log does, once a change."""
        try:
            await self.client.ping()
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            if detail != self._ready_detail:
                log.warning("not ready: Redis unreachable (%s)", detail)
                self._ready_detail = detail
            return False, "redis unreachable"
        self._ready_detail = None
        if not self.hub.connected.is_set():
            return False, "live event channel reconnecting"
        if not await self.directory.live_workers():
            return False, "no live worker"
        return True, "ok"


def _bearer(header: str | None) -> str | None:
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    return None


def _flag(value: str | None, default: bool) -> bool | None:
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in TRUE_VALUES:
        return True
    if lowered in FALSE_VALUES:
        return False
    return None


def create_app(settings: ApiSettings, redis: RedisHandle | None = None) -> FastAPI:
    handle = redis or connect(settings.redis_url)
    pod = ApiPod(settings, handle)

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
    app = FastAPI(
        title="duplex-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.pod = pod
    app.add_middleware(SecurityHeaders)
    chat_completions = ChatCompletions(
        pod.client,
        pod.keys,
        pod.directory,
        settings.chat_max_body_bytes,
        settings.chat_timeout_s,
        pod.inbox_writer,
    )

    def http_key(request: Request) -> str | None:
        return _bearer(request.headers.get("authorization")) or request.query_params.get("api_key")

    async def realtime(websocket: WebSocket, force_duplex: bool) -> None:
        subprotocols = [
            p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p
        ]
        key = _bearer(websocket.headers.get("authorization")) or websocket.query_params.get(
            "api_key"
        )
        for protocol in subprotocols:
            if protocol.startswith(KEY_SUBPROTOCOL_PREFIX):
                key = protocol[len(KEY_SUBPROTOCOL_PREFIX) :]
        # both refusals come before accept(): the client gets HTTP 403, no session exists
        if not pod.authorized(key):
            await websocket.close(code=1008, reason="invalid or missing API key")
            return
        origin = websocket.headers.get("origin")
        if not origin_allowed(
            origin, websocket.headers.get("host"), settings.allowed_origins, pod.authorized.enabled
        ):
            log.info("WebSocket from Origin %r refused (DUPLEX_ALLOWED_ORIGINS)", origin[:200])
            await websocket.close(code=1008, reason="origin not allowed")
            return
        accept = next((p for p in subprotocols if p == "realtime"), None)
        await websocket.accept(subprotocol=accept)
        query = websocket.query_params
        duplex = True if force_duplex else _flag(query.get("duplex"), True)
        if not duplex:
            body = {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "code": "unknown_event",
                    "message": "Realtime API is not available: this deployment serves duplex",
                },
            }
            await websocket.send_text(orjson.dumps(body).decode())
            await websocket.close(1000)
            return
        autostart = _flag(query.get("autostart"), True)
        resume = _flag(query.get("resume"), False)
        connection = RealtimeConnection(
            websocket,
            pod,
            model=query.get("model"),
            autostart=bool(autostart),
            resume_only=(autostart is False) or bool(resume),
            api_key=key,
        )
        pod.metrics.active_sessions.inc()
        try:
            await connection.run()
        finally:
            pod.metrics.active_sessions.dec()

    @app.websocket("/v1/realtime")
    async def realtime_route(websocket: WebSocket) -> None:
        await realtime(websocket, force_duplex=False)

    @app.websocket("/v1/duplex")
    async def duplex_route(websocket: WebSocket) -> None:
        await realtime(websocket, force_duplex=True)

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
        if not pod.authorized(http_key(request)):
            return openai_error(401, "invalid or missing API key", "invalid_api_key")
        return PlainTextResponse(pod.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not pod.authorized(http_key(request)):
            return openai_error(401, "invalid or missing API key", "invalid_api_key")
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "duplex-serve"}
            for m in await pod.directory.models()
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        if not pod.authorized(http_key(request)):
            return openai_error(401, "invalid or missing API key", "invalid_api_key")
        return await chat_completions(request)

    return app
