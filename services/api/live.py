"""One pub/sub connection per API pod, fanning live session messages out to connections.

Each subscriber gets a callback that only queues (never blocks the reader).
The pod subscribes to its own control channel at start so the reader always
has a subscription to listen on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Callback = Callable[[bytes], None]


class LiveHub:
    def __init__(self, client: Any, pod_channel: str) -> None:
        self.client = client
        self.pubsub = client.pubsub()
        self.pod_channel = pod_channel
        self._subscribers: dict[str, set[Callback]] = {}
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    async def start(self) -> None:
        await self.pubsub.subscribe(self.pod_channel)
        self._task = asyncio.create_task(self._run(), name="live-hub")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.pubsub.aclose()

    async def publish(self, channel: str, data: bytes) -> None:
        """A control notice (a cluster client has no PUBLISH: this node's connection does)."""
        await self.client.publish(channel, data)

    async def subscribe(self, channel: str, callback: Callback) -> None:
        callbacks = self._subscribers.setdefault(channel, set())
        first = not callbacks
        callbacks.add(callback)
        if first:
            await self.pubsub.subscribe(channel)

    async def unsubscribe(self, channel: str, callback: Callback) -> None:
        callbacks = self._subscribers.get(channel)
        if not callbacks:
            return
        callbacks.discard(callback)
        if not callbacks:
            del self._subscribers[channel]
            await self.pubsub.unsubscribe(channel)

    async def _run(self) -> None:
        while True:
            try:
                self.connected.set()
                async for message in self.pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    channel = message["channel"]
                    channel = channel.decode() if isinstance(channel, bytes) else channel
                    for callback in list(self._subscribers.get(channel, ())):
                        callback(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception:
                # Redis went away: resubscribe everything once it is back; journals fill the gap
                self.connected.clear()
                log.exception("live hub lost its pub/sub connection; resubscribing")
                await asyncio.sleep(0.5)
                try:
                    await self.pubsub.subscribe(self.pod_channel, *self._subscribers)
                except Exception:
                    log.warning("resubscribe failed; retrying")
