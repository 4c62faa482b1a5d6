"""A test's ear on live channels, on one Redis or a Redis Cluster alike.

On a cluster the live channels are shard channels (SPUBLISH), which a classic SUBSCRIBE
does not hear: `ShardedListener` gives the part of redis-py's `PubSub` the tests use
(`subscribe`, `get_message`, `aclose`) over the product's `ShardedSubscriber`. Its
messages are typed `smessage`, as redis-py 7's sharded pub/sub types them."""

from __future__ import annotations

import asyncio
from typing import Any

from shared.redis.connection import is_cluster
from shared.redis.sharded_pubsub import ShardedSubscriber


class ShardedListener:
    def __init__(self, cluster: Any) -> None:
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subscriber = ShardedSubscriber.of_cluster(cluster, self._heard, self._caught_up)
        self._started = False

    def _heard(self, channel: str, data: bytes) -> None:
        self._queue.put_nowait({"type": "smessage", "channel": channel.encode(), "data": data})

    def _caught_up(self, channel: str) -> None:
        pass  # a test that restarts nodes reads `ShardedSubscriber` itself

    async def subscribe(self, *channels: str) -> None:
        """Returns once every channel is subscribed (confirmed by its node)."""
        if not self._started:
            await self._subscriber.start()
            self._started = True
        for channel in channels:
            await self._subscriber.subscribe(channel)
            self._queue.put_nowait({"type": "ssubscribe", "channel": channel.encode(), "data": 1})

    async def get_message(
        self, ignore_subscribe_messages: bool = False, timeout: float = 0.0
    ) -> dict[str, Any] | None:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(self._queue.get(), max(remaining, 0.001))
            except TimeoutError:
                return None
            if not (ignore_subscribe_messages and message["type"] == "ssubscribe"):
                return message

    async def aclose(self) -> None:
        await self._subscriber.stop()


def listener_of(client: Any) -> Any:
    """A pub/sub object for `client`: sharded on a cluster, redis-py's own otherwise."""
    if is_cluster(client):
        return ShardedListener(client)
    factory = getattr(client, "pubsub_client", None)
    return (factory() if factory else client).pubsub()
