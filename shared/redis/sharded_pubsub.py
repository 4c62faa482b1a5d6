"""Sharded pub/sub on a Redis Cluster: SSUBSCRIBE each channel on the master that owns its
slot, so a SPUBLISH stays on that shard instead of crossing the whole cluster bus.

redis-py 5.x's asyncio client (held at 5.x by arq) has no sharded subscribe, so this
speaks the pub/sub replies itself over redis-py's asyncio `Connection`: one connection per
master that owns a subscribed channel's slot (`_Shard`), each read by its own supervised
loop. Replies on a shard's connection: `[b"smessage", channel, data]` (a message),
`[b"ssubscribe", channel, n]`, `[b"sunsubscribe", channel, n]`, `[b"pong", b""]`, or an
error (`MOVED <slot> <host:port>`, `CLUSTERDOWN` ...). An SSUBSCRIBE names channels of one
slot only (CROSSSLOT otherwise), so subscriptions are sent grouped by slot.

A channel can stop being subscribed without our asking, and is then subscribed again:
- the server sends `sunsubscribe` when the channel's slot migrates away from the node
  (CLUSTER SETSLOT ... NODE): the shard sends SSUBSCRIBE again on the same node, whose
  `MOVED` reply names the new owner, where the channel goes;
- an SSUBSCRIBE answered `MOVED` (a stale slot map) goes to the node the reply names;
- a lost connection (a node killed, failed over, unreachable: no reply to a PING within
  `ping_interval_s`) ends the shard's loop; its restart (after a backoff pause) re-reads
  the slot map, sends the channels whose slot moved to their new owners and subscribes
  the rest again on a new connection.
Whatever was published while a channel was not subscribed is lost to it, so once it is
subscribed again `on_resubscribed(channel)` tells the caller to fill the gap (the API pod
replays the journal). `subscribe` itself waits for the server's confirmation (the caller
relies on "subscribed before anything else happens"); if it cannot get one in time, the
late confirmation counts as a resubscription.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError, ResponseError

from shared.redis.slot_map import CONNECTION_SETTINGS, Address, SlotMap, node_connection, slot_of
from shared.supervised import SupervisedLoop

log = logging.getLogger(__name__)

OnMessage = Callable[[str, bytes], None]
OnResubscribed = Callable[[str], None]


class ShardUnavailable(RedisConnectionError):
    """A node answered with an error other than MOVED (CLUSTERDOWN while it rejoins, ...),
    or stopped answering PINGs: its connection is dropped and made again after a pause."""


class ShardedSubscriber:
    def __init__(
        self,
        seeds: Iterable[Address],
        on_message: OnMessage,
        on_resubscribed: OnResubscribed,
        *,
        settings: dict[str, Any] | None = None,
        ping_interval_s: float = 5.0,
        confirm_timeout_s: float = 5.0,
    ) -> None:
        self.settings = dict(settings or {})
        self.slots = SlotMap(seeds, self.settings)
        self.on_message = on_message
        self.on_resubscribed = on_resubscribed
        self.ping_interval_s = ping_interval_s
        self.confirm_timeout_s = confirm_timeout_s
        #: set while every node that holds a wanted channel has a live connection
        self.connected = asyncio.Event()
        self._shards: dict[Address, _Shard] = {}
        self._placed: dict[str, _Shard] = {}  # wanted channel -> the shard it belongs on
        self._waiters: dict[str, asyncio.Future[None]] = {}  # subscribe() awaiting its reply
        self._recovering: set[str] = set()  # wanted channels that missed messages

    @classmethod
    def of_cluster(
        cls, cluster: Any, on_message: OnMessage, on_resubscribed: OnResubscribed, **options: Any
    ) -> ShardedSubscriber:
        """One for the nodes and credentials of a `redis.asyncio.cluster.RedisCluster`."""
        nodes = [*cluster.nodes_manager.startup_nodes.values(), *cluster.get_nodes()]
        kwargs = cluster.get_connection_kwargs()
        settings = {name: kwargs[name] for name in CONNECTION_SETTINGS if kwargs.get(name)}
        seeds = [(node.host, int(node.port)) for node in nodes]
        return cls(seeds, on_message, on_resubscribed, settings=settings, **options)

    async def start(self) -> None:
        """Read the slot map (raises while no node answers)."""
        await self.slots.refresh()

    async def stop(self) -> None:
        shards, self._shards = list(self._shards.values()), {}
        await asyncio.gather(*(shard.stop() for shard in shards))
        self.connected.clear()

    def subscribed(self, channel: str) -> bool:
        """Is `channel` confirmed subscribed on its node now?"""
        shard = self._placed.get(channel)
        return shard is not None and channel in shard.confirmed

    async def subscribe(self, channel: str) -> None:
        if channel in self._placed:
            return
        waiter = self._waiters[channel] = asyncio.get_running_loop().create_future()
        shard = self._place(channel)
        try:
            await shard.send_subscribe([channel])
            if shard.up or shard.fresh:  # not while its node is known to be away
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.confirm_timeout_s):
                        await asyncio.shield(waiter)
        finally:
            if self._waiters.get(channel) is waiter:
                del self._waiters[channel]
        if channel in self._placed and not self.subscribed(channel):
            self._recovering.add(channel)  # subscribed later by a reconnect: catch up then
        self._update_connected()

    async def unsubscribe(self, channel: str) -> None:
        shard = self._placed.pop(channel, None)
        self._recovering.discard(channel)
        waiter = self._waiters.pop(channel, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)  # a subscribe still waiting for its confirmation returns
        if shard is not None:
            shard.assigned.discard(channel)
            await shard.send_unsubscribe(channel)
        self._update_connected()

    # ------------------------------------------------------------ for the shards

    def _place(self, channel: str) -> _Shard:
        """Assign `channel` to the shard of its slot's owner (made on first use)."""
        address = self.slots.owner(channel)
        shard = self._shards.get(address)
        if shard is None:
            shard = self._shards[address] = _Shard(self, address)
            shard.loop.start()
        shard.assigned.add(channel)
        self._placed[channel] = shard
        return shard

    async def _move(self, channels: Iterable[str]) -> None:
        """Channels whose slot left their shard: to the shard of their owner now."""
        for channel in channels:
            if channel in self._placed:
                await self._place(channel).send_subscribe([channel])
        self._update_connected()

    def _lost(self, channels: Iterable[str]) -> None:
        """These channels may have missed messages: catch up once subscribed again."""
        self._recovering.update(c for c in channels if c in self._placed)

    def _confirmed(self, channel: str) -> None:
        waiter = self._waiters.get(channel)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if channel in self._recovering:
            self._recovering.discard(channel)
            self.on_resubscribed(channel)

    def _forget(self, shard: _Shard) -> None:
        if self._shards.get(shard.address) is shard:
            del self._shards[shard.address]

    def _update_connected(self) -> None:
        if all(shard.up or shard.fresh for shard in self._shards.values() if shard.assigned):
            self.connected.set()
        else:
            self.connected.clear()


class _Shard:
    """One master's connection and the wanted channels whose slot it owns."""

    def __init__(self, owner: ShardedSubscriber, address: Address) -> None:
        self.owner = owner
        self.address = address
        self.assigned: set[str] = set()  # wanted channels of this node's slots
        self.confirmed: set[str] = set()  # SSUBSCRIBE confirmed on the current connection
        # SUNSUBSCRIBEs sent whose replies are not read yet: a `sunsubscribe` beyond these
        # is the server's own (the slot migrated away)
        self.unsubscribing: collections.Counter[str] = collections.Counter()
        self.connection: Connection | None = None
        self.up = False
        self.fresh = True  # not connected yet, and no try failed: not a reason to be unready
        self.loop = SupervisedLoop(f"live-shard-{address[0]}:{address[1]}", self._run)

    async def stop(self) -> None:
        await self.loop.stop()

    async def send_subscribe(self, channels: Iterable[str]) -> None:
        """SSUBSCRIBE, one command per slot. While down: the connect subscribes them."""
        by_slot: dict[int, list[str]] = collections.defaultdict(list)
        for channel in channels:
            by_slot[slot_of(channel)].append(channel)
        for group in by_slot.values():
            await self._send("SSUBSCRIBE", *group)

    async def send_unsubscribe(self, channel: str) -> None:
        if self.up:
            self.unsubscribing[channel] += 1
            self.confirmed.discard(channel)
            await self._send("SUNSUBSCRIBE", channel)

    async def _send(self, *command: str) -> None:
        connection = self.connection
        # only on a live connection: redis-py would quietly reconnect a dead one, behind
        # the reader's back; a failed write is the reader's to notice
        if self.up and connection is not None and connection.is_connected:
            try:
                await connection.send_command(*command, check_health=False)
            except (RedisConnectionError, OSError):
                log.info("%s to %s:%d not sent: the reconnect will", command[0], *self.address)

    async def _run(self) -> None:
        if self.loop.failures:  # a restart: where the slots are may have changed meanwhile
            await self.owner.slots.refresh()
            moved = [c for c in self.assigned if self.owner.slots.owner(c) != self.address]
            self.assigned.difference_update(moved)
            await self.owner._move(moved)
        if not self.assigned:
            self.owner._forget(self)  # nothing left here (a node gone for good)
            self.owner._update_connected()
            return
        connection = node_connection(self.address, self.owner.settings)
        try:
            await connection.connect()
            self.connection, self.up = connection, True
            await self.send_subscribe(list(self.assigned))
            self.owner._update_connected()
            await self._read(connection)
        finally:
            self.up, self.connection, self.fresh = False, None, False
            self.confirmed.clear()
            self.unsubscribing.clear()
            self.owner._lost(self.assigned)
            self.owner._update_connected()
            await connection.disconnect(nowait=True)

    async def _read(self, connection: Connection) -> None:
        pinged = False
        while True:
            try:
                reply = await connection.read_response(timeout=self.owner.ping_interval_s)
            except MovedError as moved:
                await self._moved(moved)
                continue
            except ResponseError as error:
                raise ShardUnavailable(f"{self.address[0]}:{self.address[1]}: {error}") from error
            if reply is None:  # quiet for a whole interval: is the node still there?
                if pinged:
                    raise ShardUnavailable(f"{self.address[0]}:{self.address[1]}: no PONG")
                await connection.send_command("PING", check_health=False)
                pinged = True
                continue
            pinged = False
            if not isinstance(reply, list):
                continue  # b"PONG": a PING while no channel was subscribed
            kind, channel = reply[0], reply[1]
            if kind == b"smessage":  # the one hot branch: every live event passes here
                self.owner.on_message(channel.decode(), reply[2])
            elif kind == b"ssubscribe":
                await self._subscribed(channel.decode())
            elif kind == b"sunsubscribe" and channel is not None:
                await self._unsubscribed(channel.decode())

    async def _subscribed(self, channel: str) -> None:
        if channel in self.assigned:
            self.confirmed.add(channel)
            self.owner._confirmed(channel)
        elif not self.unsubscribing[channel]:  # moved to another shard while on its way
            await self.send_unsubscribe(channel)

    async def _unsubscribed(self, channel: str) -> None:
        if self.unsubscribing[channel]:  # the reply to our SUNSUBSCRIBE
            self.unsubscribing[channel] -= 1
            if not self.unsubscribing[channel]:
                del self.unsubscribing[channel]
            return
        # the server's: the slot migrated away. Asking the same node again gets a MOVED
        # naming the new owner (or, if the slot came back, the subscription).
        self.confirmed.discard(channel)
        if channel in self.assigned:
            log.info("channel %s left %s:%d (slot migrated)", channel, *self.address)
            self.owner._lost([channel])
            await self.send_subscribe([channel])

    async def _moved(self, moved: MovedError) -> None:
        address = (moved.host, int(moved.port))
        if address == self.address:
            raise ShardUnavailable(f"{self.address[0]}:{self.address[1]}: MOVED to itself")
        self.owner.slots.learn(moved.slot_id, address)
        leaving = [
            c for c in self.assigned if slot_of(c) == moved.slot_id and c not in self.confirmed
        ]
        self.assigned.difference_update(leaving)
        await self.owner._move(leaving)
