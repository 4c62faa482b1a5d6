"""Which master of a Redis Cluster owns each hash slot, as the cluster last told us.

The sharded subscriber (`shared/redis/sharded_pubsub.py`) keeps its own map instead of
borrowing the cluster client's: it must re-read it at its own moments (after a lost
connection to a node) without disturbing the client's connections. A `MOVED` reply
teaches one slot at once (`learn`); `refresh` re-reads the whole map with CLUSTER SLOTS
from the first node that answers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from redis.asyncio.cluster import ClusterParser
from redis.asyncio.connection import Connection
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

Address = tuple[str, int]

#: what a pub/sub node connection takes from the cluster client's settings (credentials and
#: socket options; not its retry or response callbacks, which a pub/sub connection ignores)
CONNECTION_SETTINGS = (
    "username",
    "password",
    "credential_provider",
    "socket_connect_timeout",
    "socket_keepalive",
    "socket_keepalive_options",
    "client_name",
)


def slot_of(channel: str) -> int:
    """A shard channel's slot, computed as for a key (hash tags included)."""
    return key_slot(channel.encode())


def node_connection(address: Address, settings: dict[str, Any]) -> Connection:
    """A bare connection to one node; MOVED replies parse into `MovedError`."""
    host, port = address
    return Connection(host=host, port=port, parser_class=ClusterParser, **settings)


class SlotMap:
    def __init__(self, seeds: Iterable[Address], settings: dict[str, Any]) -> None:
        self._seeds = list(dict.fromkeys(seeds))
        self._settings = settings
        self._owners: list[Address | None] = [None] * REDIS_CLUSTER_HASH_SLOTS

    def owner(self, channel: str) -> Address:
        """The master to SSUBSCRIBE `channel` on (a seed while the slot is unknown: its
        MOVED reply then names the owner)."""
        return self._owners[slot_of(channel)] or self._seeds[0]

    def learn(self, slot: int, address: Address) -> None:
        self._owners[slot] = address

    def masters(self) -> list[Address]:
        return list(dict.fromkeys(a for a in self._owners if a is not None))

    async def refresh(self) -> None:
        """Re-read every slot's owner from the first node that answers (the seeds, then
        the masters known so far). Raises when none does."""
        failures: list[str] = []
        for address in dict.fromkeys([*self._seeds, *self.masters()]):
            connection = node_connection(address, self._settings)
            try:
                await connection.connect()
                await connection.send_command("CLUSTER", "SLOTS")
                ranges = await connection.read_response(timeout=5.0)
            except (RedisError, OSError) as exc:
                failures.append(f"{address[0]}:{address[1]}: {exc}")
                continue
            finally:
                await connection.disconnect()
            if not ranges:  # a node that has not joined (or timed out): ask the next one
                failures.append(f"{address[0]}:{address[1]}: no slots")
                continue
            owners: list[Address | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
            for first, last, master, *_replicas in ranges:
                host = master[0].decode() if isinstance(master[0], bytes) else master[0]
                owner = (host or address[0], int(master[1]))  # "" means "the node you asked"
                owners[int(first) : int(last) + 1] = [owner] * (int(last) - int(first) + 1)
            self._owners = owners
            return
        raise ConnectionError("no cluster node gave its slot map: " + "; ".join(failures))
