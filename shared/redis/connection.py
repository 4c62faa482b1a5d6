"""A Redis client: the real server at DUPLEX_REDIS_URL, or an embedded fakeredis with Lua."""

from __future__ import annotations

from typing import Any

import redis.asyncio as redis_async

EMBEDDED = "embedded (fakeredis, in this process)"


class RedisHandle:
    """The client plus a description for logs (never the password)."""

    def __init__(self, client: Any, description: str, server: Any = None) -> None:
        self.client = client
        self.description = description
        self.server = server  # the FakeServer, for embedded mode

    def new_client(self) -> Any:
        """Another connection to the same server (pub/sub and blocking reads need their own)."""
        if self.server is not None:
            import fakeredis

            return fakeredis.FakeAsyncRedis(server=self.server)
        return self.client

    async def close(self) -> None:
        await self.client.aclose()


def redact(url: str) -> str:
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1) if "://" in url else ("redis", url)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


def connect(url: str | None) -> RedisHandle:
    """Real Redis when `url` is set, else an embedded fakeredis server (for `duplex serve`)."""
    if url:
        client = redis_async.Redis.from_url(url, health_check_interval=10)
        return RedisHandle(client, redact(url))
    import fakeredis

    server = fakeredis.FakeServer()
    return RedisHandle(fakeredis.FakeAsyncRedis(server=server), EMBEDDED, server)
