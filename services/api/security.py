"""Who may use the API pod, and what a browser may do with its pages.

- `KeyChecker`: API keys compared as UTF-8 bytes in constant time. A key is
  client input in any alphabet; `hmac.compare_digest` raises on a non-ASCII str
  (issue 14: a 500 and a traceback per request), so both sides are hashed first,
  which also hides the keys' lengths, and every known key is compared every time.
- `origin_allowed`: the WebSocket Origin rule. Browsers attach an Origin to every
  cross-site WebSocket and send no CORS preflight, so without API keys any web
  page a user visits could drive a `duplex serve` on their machine or network.
- `SecurityHeaders`: an ASGI middleware that puts CSP, frame, nosniff and
  referrer headers on every HTTP response (the console page and its files
  above all; harmless on JSON).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: a Host header fit to be echoed into the CSP (anything else: no ws:/wss: sources)
_HOST = re.compile(r"^[A-Za-z0-9.\-]+(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?$")
_DEFAULT_PORTS = {"http": "80", "https": "443", "ws": "80", "wss": "443"}


def _digest(key: str) -> bytes:
    # surrogatepass: a str from any decoder encodes, whatever the client sent
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyChecker:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __call__(self, key: str | None) -> bool:
        if not self._digests:
            return True
        if key is None:
            return False
        candidate = _digest(key)
        matched = False
        for known in self._digests:  # no early exit: the time does not say which key
            matched |= hmac.compare_digest(candidate, known)
        return matched


def _netloc(scheme: str, netloc: str) -> str:
    """host[:port] lowercased, the scheme's default port dropped."""
    netloc = netloc.lower()
    default = _DEFAULT_PORTS.get(scheme)
    if default and netloc.endswith(":" + default):
        netloc = netloc[: -len(default) - 1]
    return netloc


def origin_allowed(
    origin: str | None, host: str | None, allowed: frozenset[str], keys_enabled: bool
) -> bool:
    """May a WebSocket handshake with this Origin header proceed?

    - no Origin: not a browser (the openai SDK, DuplexClient, curl): allowed;
    - an Origin listed in `allowed` (or `*` listed): allowed;
    - an Origin on the request's own host (the console page of this pod): allowed;
    - any other Origin: allowed only when API keys are on and no list is set (the key,
      which a foreign page does not have, is then the credential).
    """
    if origin is None or "*" in allowed:
        return True
    origin = origin.strip().rstrip("/").lower()
    if origin in allowed:
        return True
    parts = urlsplit(origin)
    if parts.scheme in ("http", "https") and host:
        scheme = parts.scheme
        if _netloc(scheme, parts.netloc) == _netloc(scheme, host.strip()):
            return True
    return keys_enabled and not allowed


def content_security_policy(host: str | None) -> str:
    """The console's policy: its own scripts, styles and worklets, sockets to itself."""
    connect = "'self'"
    if host and _HOST.match(host):
        # 'self' covers ws:/wss: in CSP 3 browsers; older ones need them spelled out
        connect += f" ws://{host} wss://{host}"
    return (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        f"connect-src {connect}; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    )


class SecurityHeaders:
    """Pure ASGI (no BaseHTTPMiddleware): streamed responses pass through untouched."""

    FIXED = (
        (b"x-frame-options", b"DENY"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
    )

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = next((v for k, v in scope["headers"] if k == b"host"), b"").decode("latin-1")
        policy = content_security_policy(host).encode()

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                for name, value in (*self.FIXED, (b"content-security-policy", policy)):
                    if name not in present:
                        headers.append((name, value))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
