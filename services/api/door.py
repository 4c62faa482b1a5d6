"""The door of every WebSocket route: who may open a socket, checked once, the same way for
every protocol, before the upgrade.

- The API key (when keys are configured): from the route's path (Moshi's clients put it in
  their base URL: `/key/<API_KEY>/api/chat`), an `Authorization: Bearer` header,
  `?api_key=`, or, from browsers, which cannot set headers on a WebSocket, the subprotocol
  `openai-insecure-api-key.<key>`. Refused with HTTP 401 `invalid_api_key`.
- The browser Origin (`security.origin_allowed`, configured by `DUPLEX_ALLOWED_ORIGINS`):
  refused with HTTP 403 `forbidden`. A client that is not a browser sends no Origin.

Both refusals are HTTP statuses with OpenAI's error body (`deny`), as OpenAI's own
Realtime endpoint answers a bad key: no session exists, and a client that reconnects at
once on a close (Moshi's) stops on a 4xx.
"""

from __future__ import annotations

import dataclasses
import logging

import orjson
from starlette.datastructures import Headers, QueryParams
from starlette.responses import Response
from starlette.websockets import WebSocket

from services.api.security import KeyChecker, origin_allowed
from shared.protocol.duplex import error_type_for

log = logging.getLogger(__name__)

#: browsers cannot set headers on a WebSocket: they send the key as this subprotocol
KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."


def offered_subprotocols(headers: Headers) -> list[str]:
    """The subprotocols a WebSocket's client offered (`Sec-WebSocket-Protocol`), in order."""
    return [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]


def bearer(header: str | None) -> str | None:
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    return None


async def deny(
    websocket: WebSocket, status: int, code: str, message: str, param: str | None = None
) -> None:
    """Refuse a WebSocket before its upgrade with an HTTP status and OpenAI's error body.
    Falls back to a 1008 close where the server has no denial responses."""
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
    """A socket past the door: the client's key (None without one), its query and the
    subprotocols it offered (the key's, if any, left out)."""

    key: str | None
    query: QueryParams
    subprotocols: tuple[str, ...]


class Door:
    def __init__(self, authorized: KeyChecker, allowed_origins: frozenset[str]) -> None:
        self.authorized = authorized
        self.allowed_origins = allowed_origins

    async def admit(self, websocket: WebSocket, path_key: str | None = None) -> Admitted | None:
        """The key and the Origin; None once the client was refused. The headers are read
        from the scope (not through `websocket.headers`, which would keep parsed copies on
        the socket for its life) and dropped once read: nothing reads them after this
        (their copy was about 0.9 KiB of every idle session, docs/benchmarks.md)."""
        headers = Headers(scope=websocket.scope)
        query = QueryParams(websocket.scope["query_string"])
        offered = offered_subprotocols(headers)
        key = path_key or bearer(headers.get("authorization")) or query.get("api_key")
        for protocol in offered:
            if protocol.startswith(KEY_SUBPROTOCOL_PREFIX):
                key = protocol[len(KEY_SUBPROTOCOL_PREFIX) :]
        if not self.authorized(key):
            await deny(websocket, 401, "invalid_api_key", "invalid or missing API key")
            return None
        origin = headers.get("origin")
        if not origin_allowed(
            origin, headers.get("host"), self.allowed_origins, self.authorized.enabled
        ):
            log.info("WebSocket from Origin %r refused (DUPLEX_ALLOWED_ORIGINS)", origin[:200])
            await deny(websocket, 403, "forbidden", "origin not allowed")
            return None
        websocket.scope["headers"] = []
        subprotocols = tuple(p for p in offered if not p.startswith(KEY_SUBPROTOCOL_PREFIX))
        return Admitted(key, query, subprotocols)
