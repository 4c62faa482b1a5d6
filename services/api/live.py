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

from shared.backoff import Backoff

log = logging.getLogger(__name__)

#: delivered to every subscriber after a reconnect: fill any gap from the journal
CATCH_UP = b"!catchup"

Callback = Callable[[bytes], None]


class LiveHub:
    def __init__(self, client: Any, pod_channel: str) -> None:
        self.client = client
        self.pubsub = client.pubsub()
        self.pod_channel = pod_channel
        self._subscribers: dict[str, set[Callback]] = {}
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        await self.pubsub.subscribe(self.pod_channel)
        self.connected.set()
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
            await self._change(self.pubsub.subscribe, channel)

    async def unsubscribe(self, channel: str, callback: Callback) -> None:
        callbacks = self._subscribers.get(channel)
        if not callbacks:
            return
        callbacks.discard(callback)
        if not callbacks:
            del self._subscribers[channel]
            await self._change(self.pubsub.unsubscribe, channel)

    async def _change(self, operation: Callable[..., Any], *channels: str) -> None:
        """Subscription changes, one at a time. While the connection is down they only
        change `_subscribers`: the reconnect subscribes to exactly those (two coroutines
        talking to a reconnecting pub/sub connection at once can lose subscriptions)."""
        if not self.connected.is_set():
            return
        async with self._lock:
            try:
                await operation(*channels)
            except Exception:
                log.warning("pub/sub %s failed; the reconnect will apply it", operation.__name__)

    async def _run(self) -> None:
        backoff = Backoff()
        while True:
            try:
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
                log.warning("live hub lost its pub/sub connection; resubscribing", exc_info=True)
                await asyncio.sleep(backoff.next_delay())
                try:
                    async with self._lock:
                        await self.pubsub.subscribe(self.pod_channel, *self._subscribers)
                    self.connected.set()  # only now: readiness depends on it
                    backoff.reset()
                    for callbacks in list(self._subscribers.values()):
                        for callback in list(callbacks):
                            callback(CATCH_UP)  # replay what was published while we were away
                except Exception:
                    log.warning("resubscribe failed; retrying")
