"""The API pod: FastAPI app with the Realtime WebSocket, models, health, chat and metrics.

Stateless: everything that outlives a socket is in Redis. `ApiPod` holds the
pod-wide pieces (Redis client, scripts, the live hub, the worker directory,
metrics); `create_app` wires them into routes.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from fastapi.staticfiles import StaticFiles

from services.api.connection import RealtimeConnection
from services.api.inbox_writer import InboxWriter
from services.api.janitor import Janitor
from services.api.live import LiveHub
from services.api.liveness import PodLiveness
from services.api.metrics import ApiMetrics
from services.api.placement import WorkerDirectory
from shared.contracts import SessionRuntimeConfig
from shared.redis.connection import RedisHandle, connect
from shared.redis.keys import KeySchema
from shared.redis.messages import CHAT, InboxMessage
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
        self.inbox_writer = InboxWriter(self.client, self.keys, self.store.scripts)
        self.liveness = PodLiveness(
            self.client, self.keys, self.store, settings.pod_id, settings.heartbeat_interval_s
        )

    def new_session_id(self) -> str:
        return "duplex-" + uuid.uuid4().hex

    async def start(self) -> None:
        await self.store.scripts.ensure_loaded(self.client)
        await self.hub.start()
        await self.liveness.start()
        await self.janitor.start()

    async def stop(self) -> None:
        await self.janitor.stop()
        await self.liveness.stop()
        await self.hub.stop()
        await self.inbox_writer.stop()
        with contextlib.suppress(Exception):
            await self.client.zrem(self.keys.apis(), self.settings.pod_id)

    def authorized(self, key: str | None) -> bool:
        keys = self.settings.api_keys
        if not keys:
            return True
        return key is not None and any(hmac.compare_digest(key, known) for known in keys)

    async def ready(self) -> tuple[bool, str]:
        try:
            await self.client.ping()
        except Exception as exc:
            return False, f"redis unreachable: {exc}"
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


def _openai_error(
    status: int, message: str, code: str, error_type: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": error_type, "code": code}}, status_code=status
    )


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

    app = FastAPI(title="duplex-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pod = pod

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
        if not pod.authorized(key):
            await websocket.close(
                code=1008, reason="invalid or missing API key"
            )  # before any session exists
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
            return _openai_error(401, "invalid or missing API key", "invalid_api_key")
        return PlainTextResponse(pod.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not pod.authorized(http_key(request)):
            return _openai_error(401, "invalid or missing API key", "invalid_api_key")
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "duplex-serve"}
            for m in await pod.directory.models()
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        if not pod.authorized(http_key(request)):
            return _openai_error(401, "invalid or missing API key", "invalid_api_key")
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _openai_error(400, "the body is not JSON", "invalid_json")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _openai_error(400, "messages must be a list", "bad_event")
        model = body.get("model")
        workers = [
            w
            for w in await pod.directory.candidates(model)
            if w.capabilities.get("supports_chat_completions")
        ]
        if not workers:
            return _openai_error(
                404, f"no live worker serves chat completions for {model!r}", "model_not_found"
            )
        request_id = uuid.uuid4().hex
        await pod.inbox_writer.append(
            workers[0].worker_id,
            InboxMessage(CHAT, request_id, payload={"messages": body["messages"]}).to_fields(),
        )
        reply = await pod.client.blpop(
            [pod.keys.reply(request_id)], timeout=int(settings.chat_timeout_s)
        )
        if reply is None:
            return _openai_error(
                504, "the worker did not answer in time", "timeout", "server_error"
            )
        answer = orjson.loads(reply[1])
        if not answer["ok"]:
            status = 429 if answer["code"] == "resource_exhausted" else 400
            return _openai_error(status, answer["message"], answer["code"])
        completion_id = f"chatcmpl-{request_id}"
        served = model or workers[0].model
        if body.get("stream"):
            return StreamingResponse(
                _chat_stream(completion_id, served, answer["text"]), media_type="text/event-stream"
            )
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": served,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": answer["text"]},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )

    return app


async def _chat_stream(completion_id: str, model: str, text: str) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        body = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    words = text.split(" ")
    for index, word in enumerate(words):
        yield chunk({"content": word if index == 0 else " " + word})
    yield chunk({}, "stop")
    yield b"data: [DONE]\n\n"
