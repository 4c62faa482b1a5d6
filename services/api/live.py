"""One pub/sub connection per API pod, fanning live session messages out to connections.

Each subscriber gets a callback that only queues (never blocks the reader): a
connection's is its `LiveFeed`. The pod subscribes to its own control channel at start
so the reader always has a subscription to listen on.

The reader runs as a supervised loop: a lost connection ends it with an error (logged,
readiness false), and its restart subscribes every channel again before it listens,
then tells each subscriber to `CATCH_UP` from the journals.

On a Redis Cluster the channels are shard channels (the workers SPUBLISH): a
`ShardedSubscriber` holds one connection per master that owns a subscribed channel's
slot and SSUBSCRIBEs each channel there. It recovers per channel (a slot migrated, a
MOVED reply, a lost node: subscribed again on the owner), and each channel subscribed
again gets `CATCH_UP`; readiness is false while any of those masters is unreachable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from services.api.waitables import Mailbox
from shared.backoff import Backoff
from shared.redis.connection import is_cluster, publish_live
from shared.redis.live_message import CATCHUP_KIND, CONTROL_PREFIX
from shared.redis.sharded_pubsub import ShardedSubscriber
from shared.supervised import SupervisedLoop

log = logging.getLogger(__name__)

#: delivered to every subscriber after a reconnect: fill any gap from the journal
CATCH_UP = CONTROL_PREFIX + CATCHUP_KIND.encode()  # a notice of the hub's own

Callback = Callable[[bytes], None]


class LiveFeed:
    """What one connection hears on its session's live channel, in arrival order: events,
    control notices and `CATCH_UP`. The open reads its first reply here, then the
    delivery pump reads the rest."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        # not an asyncio.Queue: that allocates four deques (3 KiB) even while nothing is
        # queued, and most sessions are idle (services/api/waitables.py)
        self._queue: Mailbox[bytes] = Mailbox()

    def push(self, data: bytes) -> None:
        """The hub's callback: only queues, so the hub's reader never waits."""
        self._queue.put_nowait(data)

    async def get(self) -> bytes:
        return await self._queue.get()


class LiveHub:
    def __init__(self, client: Any, pod_channel: str) -> None:
        self.client = client
        self.pod_channel = pod_channel
        self._subscribers: dict[str, set[Callback]] = {}
        self._lock = asyncio.Lock()
        self._reader = SupervisedLoop("live-hub", self._listen, backoff=Backoff())
        #: on a cluster: the per-shard subscriber (then there is no classic `pubsub`)
        self.sharded: ShardedSubscriber | None = None
        if is_cluster(client):
            self.sharded = ShardedSubscriber.of_cluster(client, self._deliver, self._catch_up)
            self.connected = self.sharded.connected
        else:
            self.pubsub = client.pubsub()
            self.connected = asyncio.Event()

    async def start(self) -> None:
        if self.sharded is not None:
            await self.sharded.start()
            # the pod channel keeps a connection, and so readiness, even with no session
            await self.sharded.subscribe(self.pod_channel)
            return
        await self.pubsub.subscribe(self.pod_channel)
        self.connected.set()
        self._reader.start()

    async def stop(self) -> None:
        if self.sharded is not None:
            await self.sharded.stop()
            return
        await self._reader.stop()
        await self.pubsub.aclose()

    def listening(self, channel: str) -> bool:
        """Does any connection of this pod listen to `channel`?"""
        return bool(self._subscribers.get(channel))

    async def publish(self, channel: str, data: bytes) -> None:
        """A control notice (SPUBLISH on a cluster: where the channel's subscribers are)."""
        await publish_live(self.client, channel, data)

    async def subscribe(self, channel: str, callback: Callback) -> None:
        """Once this returns, what is published on `channel` reaches `callback` (or, should
        the connection be down, `CATCH_UP` will once it is back)."""
        callbacks = self._subscribers.setdefault(channel, set())
        first = not callbacks
        callbacks.add(callback)
        if first and self.sharded is not None:
            await self.sharded.subscribe(channel)
        elif first:
            await self._change(self.pubsub.subscribe, channel)

    async def unsubscribe(self, channel: str, callback: Callback) -> None:
        callbacks = self._subscribers.get(channel)
        if not callbacks:
            return
        callbacks.discard(callback)
        if not callbacks:
            del self._subscribers[channel]
            if self.sharded is not None:
                await self.sharded.unsubscribe(channel)
            else:
                await self._change(self.pubsub.unsubscribe, channel)

    def _deliver(self, channel: str, data: bytes) -> None:
        for callback in list(self._subscribers.get(channel, ())):
            callback(data)

    def _catch_up(self, channel: str) -> None:
        """The sharded subscriber lost `channel` for a while and has it again."""
        self._deliver(channel, CATCH_UP)

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

    async def _listen(self) -> None:
        """Fan messages out until the connection fails (the loop restarts this after a
        pause). A restart after a failure first subscribes to every channel again."""
        if not self.connected.is_set():
            await self._resubscribe()
        try:
            while True:  # listen() ends when nothing is subscribed: the pod channel always is
                async for message in self.pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    channel = message["channel"]
                    channel = channel.decode() if isinstance(channel, bytes) else channel
                    for callback in list(self._subscribers.get(channel, ())):
                        callback(message["data"])
        except Exception:
            # Redis went away: readiness turns false; the journals fill the gap once back
            self.connected.clear()
            raise

    async def _resubscribe(self) -> None:
        async with self._lock:
            await self.pubsub.subscribe(self.pod_channel, *self._subscribers)
        self.connected.set()  # only now: readiness depends on it
        for callbacks in list(self._subscribers.values()):
            for callback in list(callbacks):
                callback(CATCH_UP)  # replay what was published while we were away
