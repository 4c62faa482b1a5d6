"""The Realtime WebSocket's door: who may open a socket, and with which options.

Before `accept()`: the API key (an `Authorization: Bearer` header, `?api_key=`, or, from
browsers, which cannot set headers on a WebSocket, the subprotocol
`openai-insecure-api-key.<key>`) and the browser Origin. Either refusal closes with 1008
before the handshake completes, so the client gets HTTP 403 and no session exists.
After it: the query's `duplex`, `autostart` and `resume` flags, then the connection.

Two surfaces share the route: `/v1/realtime` without `?duplex=1` is OpenAI's Realtime GA
API ("openai": GA's events, defaults and reasons, nothing of ours), `?duplex=1` and
`/v1/duplex` are the duplex protocol (docs/wire-api.md, Connecting).

The app (services/api/app.py, `DuplexApp`) hands those routes' sockets to the endpoint
at its door (`realtime_route`), past FastAPI's middleware, router and per-request
machinery.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import orjson
from starlette.datastructures import Headers, QueryParams
from starlette.responses import Response
from starlette.types import Scope
from starlette.websockets import WebSocket

from services.api.connection import RealtimeConnection
from services.api.metrics import ApiMetrics
from services.api.security import KeyChecker, origin_allowed
from shared.protocol.duplex import SURFACE_DUPLEX, SURFACE_OPENAI, error_type_for

log = logging.getLogger(__name__)

TRUE_VALUES = {"1", "true", "on", "yes"}
FALSE_VALUES = {"0", "false", "off", "no"}
#: browsers cannot set headers on a WebSocket: they send the key as this subprotocol
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."

#: builds the connection of an accepted socket (ApiPod.connection)
ConnectionFactory = Callable[..., RealtimeConnection]
#: the Realtime WebSocket routes, and whether each serves the duplex surface whatever
#: the query says
REALTIME_PATHS = {"/v1/realtime": False, "/v1/duplex": True}


def bearer(header: str | None) -> str | None:
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    return None


async def deny(
    websocket: WebSocket, status: int, code: str, message: str, param: str | None = None
) -> None:
    """Refuse a WebSocket before its upgrade with an HTTP status and OpenAI's error body (the
    protocols whose clients stop for good on a 4xx, and reconnect at once on a close:
    Moshi's). Falls back to a 1008 close where the server has no denial responses."""
    error: dict[str, str] = {"type": error_type_for(code), "code": code, "message": message}
    if param is not None:
        error["param"] = param
    response = Response(
        orjson.dumps({"error": error}),
        status_code=status,
        media_type="application/json",
        headers={"Retry-After": "1"} if status == 429 else None,
    )
    try:
        await websocket.send_denial_response(response)
    except RuntimeError:  # no websocket.http.response extension: a close is all there is
        await websocket.close(code=1008, reason=message[:120])


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A native surface's socket past its door: the client's key (None without one)."""

    key: str | None
    query: QueryParams


async def admit_native(
    websocket: WebSocket,
    authorized: KeyChecker,
    allowed_origins: frozenset[str],
    path_key: str | None = None,
) -> Admitted | None:
    """The door of Moshi's and GPT-Live's routes: the key (from the path, a Bearer header or
    `?api_key=`) and the browser Origin, refused with HTTP 401 / 403 before the upgrade
    (`deny`); None once refused."""
    headers = Headers(scope=websocket.scope)
    query = QueryParams(websocket.scope["query_string"])
    key = path_key or bearer(headers.get("authorization")) or query.get("api_key")
    if not authorized(key):
        await deny(websocket, 401, "invalid_api_key", "invalid or missing API key")
        return None
    origin = headers.get("origin")
    if not origin_allowed(origin, headers.get("host"), allowed_origins, authorized.enabled):
        await deny(websocket, 403, "forbidden", "origin not allowed")
        return None
    return Admitted(key, query)


def flag(value: str | None, default: bool) -> bool | None:
    """A query flag: True, False, `default` when absent, None when not a boolean."""
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in TRUE_VALUES:
        return True
    if lowered in FALSE_VALUES:
        return False
    return None


class RealtimeEndpoint:
    def __init__(
        self,
        authorized: KeyChecker,
        allowed_origins: frozenset[str],
        metrics: ApiMetrics,
        connection: ConnectionFactory,
    ) -> None:
        self.authorized = authorized
        self.allowed_origins = allowed_origins
        self.metrics = metrics
        self.connection = connection

    async def __call__(self, websocket: WebSocket, force_duplex: bool) -> None:
        connection = await self._admit(websocket, force_duplex)
        if connection is None:
            return
        self.metrics.active_sessions.inc()
        try:
            await connection.run()
        finally:
            self.metrics.active_sessions.dec()

    async def _admit(self, websocket: WebSocket, force_duplex: bool) -> RealtimeConnection | None:
        """The door: the connection of an accepted socket, or None when it was refused
        (and closed). Its own frame, so what it read of the request is let go once the
        socket is admitted; the headers and query are read from the scope, not through
        `websocket.headers`, which would keep parsed copies on the socket for its life.
        Nothing reads a socket's request headers after this: they are dropped."""
        headers = Headers(scope=websocket.scope)
        query = QueryParams(websocket.scope["query_string"])
        subprotocols = [
            p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p
        ]
        key = bearer(headers.get("authorization")) or query.get("api_key")
        for protocol in subprotocols:
            if protocol.startswith(KEY_SUBPROTOCOL_PREFIX):
                key = protocol[len(KEY_SUBPROTOCOL_PREFIX) :]
        # both refusals come before accept(): the client gets HTTP 403, no session exists
        if not self.authorized(key):
            await websocket.close(code=1008, reason="invalid or missing API key")
            return None
        origin = headers.get("origin")
        if not origin_allowed(
            origin, headers.get("host"), self.allowed_origins, self.authorized.enabled
        ):
            log.info("WebSocket from Origin %r refused (DUPLEX_ALLOWED_ORIGINS)", origin[:200])
            await websocket.close(code=1008, reason="origin not allowed")
            return None
        accept = next((p for p in subprotocols if p == "realtime"), None)
        await websocket.accept(subprotocol=accept)
        duplex = True if force_duplex else flag(query.get("duplex"), False)
        if duplex is None:
            body = {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "code": "invalid_session_config",
                    "message": "duplex must be one of 1/true/on/yes or 0/false/off/no",
                    "param": "duplex",
                },
            }
            await websocket.send_text(orjson.dumps(body).decode())
            await websocket.close(1000)
            return None
        autostart = flag(query.get("autostart"), True)
        resume = flag(query.get("resume"), False)
        connection = self.connection(
            websocket,
            model=query.get("model"),
            autostart=bool(autostart),
            resume_only=(autostart is False) or bool(resume),
            api_key=key,
        )
        connection.use_surface(SURFACE_DUPLEX if duplex else SURFACE_OPENAI)
        # Read here only: the scope lives as long as the socket, and its copy of the request
        # headers was about 0.9 KiB of every idle session (docs/benchmarks.md, memory).
        websocket.scope["headers"] = []
        return connection


def websocket_path(scope: Scope) -> str | None:
    """A WebSocket's path below the root path (matched as the router does); None for any
    other scope."""
    if scope["type"] != "websocket":
        return None
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path


def realtime_route(scope: Scope) -> bool | None:
    """For a WebSocket on one of `REALTIME_PATHS`: whether that route serves the duplex
    surface whatever the query says. None for any other scope."""
    path = websocket_path(scope)
    return REALTIME_PATHS.get(path) if path is not None else None
