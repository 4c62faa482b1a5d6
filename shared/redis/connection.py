"""A Redis client: the real server at DUPLEX_REDIS_URL, a Redis Cluster, or an embedded fakeredis.

URLs: `redis://host:port/db` (one Redis), `redis+cluster://host:port` (a Redis
Cluster, any node as the seed), or unset (embedded fakeredis with Lua, for
`duplex serve` only).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as redis_async
from redis.asyncio.cluster import RedisCluster

EMBEDDED = "embedded (fakeredis, in this process)"
CLUSTER_SCHEME = "redis+cluster://"


class RedisHandle:
    """The client plus a description for logs (never the password)."""

    def __init__(
        self, client: Any, description: str, server: Any = None, seed_url: str | None = None
    ) -> None:
        self.client = client
        self.description = description
        self.server = server  # the FakeServer, for embedded mode
        self.seed_url = seed_url  # a cluster node, for pub/sub
        self.cluster = isinstance(client, RedisCluster)

    def new_client(self) -> Any:
        """Another connection to the same server (blocking reads get their own)."""
        if self.server is not None:
            import fakeredis

            return fakeredis.FakeAsyncRedis(server=self.server)
        return self.client

    def pubsub_client(self) -> Any:
        """A client whose pubsub() works. On a cluster, classic PUBLISH reaches every
        node, so one node's connection hears every channel."""
        if self.cluster:
            return redis_async.Redis.from_url(self.seed_url)
        return self.new_client()

    async def close(self) -> None:
        await self.client.aclose()


def redact(url: str) -> str:
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1) if "://" in url else ("redis", url)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


def connect(url: str | None) -> RedisHandle:
    """Real Redis (or Redis Cluster) when `url` is set, else an embedded fakeredis server."""
    if url and url.startswith(CLUSTER_SCHEME):
        seed = "redis://" + url[len(CLUSTER_SCHEME) :]
        client = RedisCluster.from_url(seed)
        return RedisHandle(client, f"Redis Cluster via {redact(seed)}", seed_url=seed)
    if url:
        client = redis_async.Redis.from_url(url, health_check_interval=10)
        return RedisHandle(client, redact(url))
    import fakeredis

    server = fakeredis.FakeServer()
    return RedisHandle(fakeredis.FakeAsyncRedis(server=server), EMBEDDED, server)
