"""Ids and clock readings that more than one process makes: one definition each.

Imports nothing of ours (the admin CLI and the Redis store use it without the codec).
"""

from __future__ import annotations

import hashlib
import time
import uuid

#: the reason a session closes with when its lease expired (idle TTL or disconnect grace):
#: the janitor sends it in its close, the worker's reaper closes with it
EXPIRED_CLOSE_REASON = "timeout"


def new_session_id() -> str:
    """`duplex-<uuid4 hex>`, allocated by the server, never reused (reference contract)."""
    return "duplex-" + uuid.uuid4().hex


def now_ms() -> int:
    """Wall-clock milliseconds: what the session hash, the lease index and the heartbeat
    registries store (every process compares them, so monotonic clocks would not do)."""
    return int(time.time() * 1000)


def token_digest(token: str) -> str:
    """Only the SHA-256 of a resume token is ever stored."""
    return hashlib.sha256(token.encode()).hexdigest()


def key_digest(api_key: str) -> str:
    """The SHA-256 of the API key that opened a session (the key itself is never stored)."""
    return hashlib.sha256(api_key.encode("utf-8", "surrogateescape")).hexdigest()
