"""The Realtime WebSocket's door: who may open a socket, and with which options.

Before `accept()`: the door every route shares (`door.py`: the API key and the browser
Origin, refused with HTTP 401 / 403). After it: the query's `duplex`, `autostart` and
`resume` flags, then the connection.

Two surfaces share the route: `/v1/realtime` without `?duplex=1` is OpenAI's Realtime GA
API ("openai": GA's events, defaults and reasons, nothing of ours), `?duplex=1` and
`/v1/duplex` are the duplex protocol (docs/wire-api.md, Connecting).

The app (services/api/app.py, `DuplexApp`) hands those routes' sockets to the endpoint
at its door (`realtime_route`), past FastAPI's middleware, router and per-request
machinery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import orjson
from starlette.types import Scope
from starlette.websockets import WebSocket

from services.api.connection import RealtimeConnection
from services.api.door import Door
from services.api.metrics import ApiMetrics
from services.api.socket_driver import SocketEndpoint
from shared.protocol.duplex import SURFACE_DUPLEX, SURFACE_OPENAI

log = logging.getLogger(__name__)

TRUE_VALUES = {"1", "true", "on", "yes"}
FALSE_VALUES = {"0", "false", "off", "no"}

#: builds the connection of an accepted socket (ApiPod.connection)
ConnectionFactory = Callable[..., RealtimeConnection]
#: the Realtime WebSocket routes, and whether each serves the duplex surface whatever
#: the query says
REALTIME_PATHS = {"/v1/realtime": False, "/v1/duplex": True}


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


class RealtimeEndpoint(SocketEndpoint):
    """`/v1/realtime` (the openai surface, or the duplex one with `?duplex=1`) and
    `/v1/duplex` (the duplex surface)."""

    def __init__(self, door: Door, metrics: ApiMetrics, connection: ConnectionFactory) -> None:
        self.door = door
        self.metrics = metrics
        self.connection = connection

    def match(self, path: str) -> tuple[bool] | None:
        force_duplex = REALTIME_PATHS.get(path)
        return None if force_duplex is None else (force_duplex,)

    async def __call__(self, websocket: WebSocket, force_duplex: bool) -> None:  # type: ignore[override]
        connection = await self._admit(websocket, force_duplex)
        if connection is None:
            return
        self.metrics.active_sessions.inc()
        try:
            await connection.run()
        finally:
            self.metrics.active_sessions.dec()

    async def _admit(self, websocket: WebSocket, force_duplex: bool) -> RealtimeConnection | None:
        """The door (`Door.admit`: the key and the Origin, refused before the upgrade), then
        the query's flags: the connection of an accepted socket, or None when it was
        refused. Its own frame, so what it read of the request is let go once the socket is
        admitted."""
        admitted = await self.door.admit(websocket)
        if admitted is None:
            return None
        query = admitted.query
        accept = next((p for p in admitted.subprotocols if p == "realtime"), None)
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
            api_key=admitted.key,
        )
        connection.use_surface(SURFACE_DUPLEX if duplex else SURFACE_OPENAI)
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
