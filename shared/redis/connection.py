"""A Redis client: the real server at DUPLEX_REDIS_URL, a Redis Cluster, or an embedded fakeredis.

URLs: `redis://host:port/db` (one Redis), `redis+cluster://host:port` (a Redis
Cluster, any node as the seed), or unset (embedded fakeredis with Lua, for
`duplex serve` only).

Live channels on a cluster are shard channels: SPUBLISH goes to the master that owns the
channel's slot and stays there (classic PUBLISH is copied to every node over the cluster
bus), and the API pod listens with SSUBSCRIBE on that master
(`shared/redis/sharded_pubsub.py`).
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
        self.seed_url = seed_url  # the cluster node it was given (for operators)
        self.cluster = isinstance(client, RedisCluster)

    def new_client(self) -> Any:
        """Another connection to the same server (blocking reads get their own)."""
        if self.server is not None:
            import fakeredis

            return fakeredis.FakeAsyncRedis(server=self.server)
        return self.client

    def pubsub_client(self) -> Any:
        """The client a `LiveHub` listens through: another connection to one Redis, or on
        a cluster the cluster client itself (the hub subscribes per shard from its nodes)."""
        if self.cluster:
            return self.client
        return self.new_client()

    async def publish(self, channel: str, data: bytes) -> int:
        """A message on a live channel (see `publish_live`)."""
        return await publish_live(self.client, channel, data)

    async def close(self) -> None:
        await self.client.aclose()


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


async def publish_live(client: Any, channel: str, data: bytes) -> int:
    """PUBLISH on one Redis; on a cluster SPUBLISH, which the cluster client sends to the
    owner of the channel's slot (it parses the channel as the key), so the message reaches
    that shard's subscribers and no other node."""
    if isinstance(client, RedisCluster):
        return int(await client.execute_command("SPUBLISH", channel, data))
    return int(await client.publish(channel, data))


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
