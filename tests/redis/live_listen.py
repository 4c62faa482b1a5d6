"""A test's ear on one session's live channel: SUBSCRIBE on one Redis (or fakeredis),
SSUBSCRIBE on the master that owns the channel's slot on a Redis Cluster (event_publish.lua
SPUBLISHes there). Yields each message's payload, and the records it splits into."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection

from shared.redis.live_message import LiveRecord, split


class LiveListener:
    def __init__(self, client: Any, channel: str) -> None:
        self.client = client
        self.channel = channel
        self._pubsub: Any = None
        self._connection: Connection | None = None

    async def __aenter__(self) -> LiveListener:
        if isinstance(self.client, RedisCluster):
            node = self.client.get_node_from_key(self.channel)
            self._connection = Connection(host=node.host, port=node.port)
            await self._connection.connect()
            await self._connection.send_command("SSUBSCRIBE", self.channel)
            await self._connection.read_response()  # the confirmation
        else:
            self._pubsub = self.client.pubsub()
            await self._pubsub.subscribe(self.channel)
            await self._pubsub.get_message(timeout=1)  # the confirmation
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._connection is not None:
            await self._connection.disconnect()
        if self._pubsub is not None:
            await self._pubsub.aclose()

    async def message(self, timeout: float = 2.0) -> bytes:
        """The next message's payload (raises TimeoutError when none comes in time)."""
        async with asyncio.timeout(timeout):
            while True:
                if self._connection is not None:
                    reply = await self._connection.read_response()
                    if reply and reply[0] == b"smessage":
                        return bytes(reply[2])
                else:
                    message = await self._pubsub.get_message(timeout=timeout)
                    if message and message["type"] == "message":
                        return bytes(message["data"])

    async def records(self, count: int, timeout: float = 2.0) -> list[LiveRecord]:
        """Messages split into records until `count` records came."""
        records: list[LiveRecord] = []
        while len(records) < count:
            records += split(await self.message(timeout))
        return records
