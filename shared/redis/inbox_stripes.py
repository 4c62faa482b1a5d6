"""A worker's inbox stripes: on a Redis Cluster, one inbox stream per master, so that a
master failing over pauses the sessions whose own keys it holds, and no other.

Every key of one worker carries the worker's id as its hash tag (`{WID}`): one slot, one
master. With one inbox stream there, every session of the worker waited whenever that
master did, wherever the session's own keys (lease, journal, checkpoint) were. On a
cluster a worker has a stripe per master instead: stripe 0 is its own tag, and for each
other master the first tag `{WID:s<k>}` that hashes to a slot of that master. The worker
announces them (`duplex:worker:{WID}:stripes`, JSON: stripe -> the slot ranges it serves)
and reads every one (a blocking reader each). A session's inbox messages (its commands,
opens and closes from API pods, its restore and forwarded messages from a drain or the
dead-worker sweep) go to the stripe whose ranges hold the session's own slot
(`for_session`), in every process alike: one session's messages share one stream, so their
order holds, and share their master with the session's keys, so they fail over together.

The announcement is an id's for good: it is written once (`SET NX`) and outlives the
worker's registration (a drain's leave and the dead-worker sweep delete the streams, not
it; it expires a week after the id's last heartbeat). A worker restarted under the same id
takes it rather than choosing again, so every process may keep what it read once: a
session's messages never change streams half-way, and none goes to a stream nobody reads.
A slot no stripe lists (the cluster was resharded since) goes to stripe 0: its sessions
share that master's fate again, in order still. On a single Redis (or Sentinel) there is
one stripe, 0, and no announcement.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
from collections import OrderedDict
from typing import Any

import orjson
from redis.asyncio.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import ResponseError

from shared.redis.keys import INBOX_GROUP, KeySchema

log = logging.getLogger(__name__)

#: how long an id's announcement outlives its worker's last heartbeat
ANNOUNCED_TTL_S = 7 * 24 * 3600
#: tags tried per master before giving up on a stripe of its own (a tag lands on a master
#: with its share of the slots: a third of them on 3 masters, so a few tries suffice)
MAX_TAG_TRIES = 100_000
#: workers whose stripes a process keeps (a cache: a worker's announcement never changes)
CACHED_WORKERS = 4096


@dataclasses.dataclass(frozen=True)
class InboxStripes:
    """A worker's stripes: which stripe serves each slot range. Empty: one stripe, 0."""

    #: (first slot, last slot, stripe), sorted by first slot, not overlapping
    ranges: tuple[tuple[int, int, int], ...] = ()

    @property
    def stripes(self) -> tuple[int, ...]:
        """Every stripe the worker reads, 0 always among them."""
        return tuple(sorted({0, *(stripe for _, _, stripe in self.ranges)}))

    def for_slot(self, slot: int) -> int:
        index = bisect.bisect_right(self.ranges, (slot, REDIS_CLUSTER_HASH_SLOTS, 0)) - 1
        if index >= 0:
            first, last, stripe = self.ranges[index]
            if first <= slot <= last:
                return stripe
        return 0

    def for_session(self, keys: KeySchema, session_id: str) -> int:
        """The stripe of a session's inbox messages: the one on its own keys' master."""
        if not self.ranges:
            return 0
        return self.for_slot(key_slot(keys.session(session_id).encode()))

    def to_json(self) -> bytes:
        """`{"<stripe>": [[first, last], ...], ...}`: what redis-cli shows in the hash."""
        by_stripe: dict[str, list[list[int]]] = {}
        for first, last, stripe in self.ranges:
            by_stripe.setdefault(str(stripe), []).append([first, last])
        return orjson.dumps(by_stripe)

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> InboxStripes:
        """The announcement read back; absent or empty: one stripe."""
        if not raw:
            return cls()
        decoded = orjson.loads(raw)
        if not isinstance(decoded, dict):
            raise ValueError(f"inbox stripes are not a JSON object: {raw!r}")
        ranges = [
            (int(first), int(last), int(stripe))
            for stripe, spans in decoded.items()
            for first, last in spans
        ]
        return cls(tuple(sorted(ranges)))


def _slots(spans: list[tuple[int, int]]) -> list[int]:
    return [slot for first, last in spans for slot in range(first, last + 1)]


def _master_ranges(client: RedisCluster) -> dict[str, list[tuple[int, int]]]:
    """Each master's slot ranges, as the cluster client last learned them."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    nodes = client.nodes_manager
    previous: str | None = None
    for slot in range(REDIS_CLUSTER_HASH_SLOTS):
        owners = nodes.slots_cache.get(slot)
        name = owners[0].name if owners else None
        if name is None:
            previous = None
            continue
        spans = ranges.setdefault(name, [])
        if name == previous:
            spans[-1] = (spans[-1][0], slot)
        else:
            spans.append((slot, slot))
        previous = name
    return ranges


async def choose_stripes(client: Any, keys: KeySchema, worker_id: str) -> InboxStripes:
    """A worker's stripes for the cluster as it is now: the master of its own tag keeps
    stripe 0, every other master gets the first `k` whose stripe tag is in its slots. On
    a single Redis: one stripe."""
    if not isinstance(client, RedisCluster):
        return InboxStripes()
    await client.initialize()  # the slot map, if no command has loaded it yet
    masters = _master_ranges(client)
    master_of = {slot: name for name, spans in masters.items() for slot in _slots(spans)}
    stripe_of: dict[str, int] = {}  # master -> its stripe (k = 0 first: the worker's tag)
    for k in range(MAX_TAG_TRIES):
        name = master_of.get(key_slot(keys.inbox(worker_id, k).encode()))
        if name is not None:
            stripe_of.setdefault(name, k)
        if len(stripe_of) == len(masters):
            break
    ranges = [
        (first, last, stripe_of[name])
        for name, spans in masters.items()
        if name in stripe_of
        for first, last in spans
    ]
    return InboxStripes(tuple(sorted(ranges)))


async def announce(client: Any, keys: KeySchema, worker_id: str) -> InboxStripes:
    """The worker's stripes: those its id announced before, else new ones for the cluster as
    it is, announced (`SET NX`: of two processes under one id, the first one's stand). On a
    single Redis: one stripe, nothing written."""
    if not isinstance(client, RedisCluster):
        return InboxStripes()
    key = keys.inbox_stripes(worker_id)
    announced = await client.get(key)
    if announced is None:
        chosen = await choose_stripes(client, keys, worker_id)
        if await client.set(key, chosen.to_json(), nx=True, ex=ANNOUNCED_TTL_S):
            return chosen
        announced = await client.get(key)
    await client.expire(key, ANNOUNCED_TTL_S)
    return InboxStripes.from_json(announced)


class StripeDirectory:
    """Every worker's announced stripes, read once per worker and kept: an id's
    announcement never changes (`announce`). A worker with none has one stripe: on a single
    Redis that is kept too; on a cluster it is asked again next time (a worker that has not
    announced yet, or an announcement Redis lost)."""

    def __init__(self, client: Any, keys: KeySchema) -> None:
        self.client = client
        self.keys = keys
        self.cluster = isinstance(client, RedisCluster)
        self._known: OrderedDict[str, InboxStripes] = OrderedDict()

    def learn(self, worker_id: str, stripes: InboxStripes) -> None:
        """A worker's stripes (its own process knows them without asking)."""
        self._known[worker_id] = stripes
        self._known.move_to_end(worker_id)
        while len(self._known) > CACHED_WORKERS:
            self._known.popitem(last=False)

    def known(self, worker_id: str) -> InboxStripes | None:
        return self._known.get(worker_id)

    async def of(self, worker_id: str) -> InboxStripes:
        """The worker's stripes (one GET the first time on a cluster; Redis' errors raise)."""
        stripes = self._known.get(worker_id)
        if stripes is not None:
            return stripes
        if not self.cluster:
            stripes = InboxStripes()
        else:
            raw = await self.client.get(self.keys.inbox_stripes(worker_id))
            if raw is None:
                return InboxStripes()
            try:
                stripes = InboxStripes.from_json(raw)
            except (ValueError, TypeError):
                # not ours to fix here: its stripe 0, which the worker always reads
                log.warning("worker %s's inbox stripes do not decode: %r", worker_id, raw)
                stripes = InboxStripes()
        self.learn(worker_id, stripes)
        return stripes

    async def inbox_of(self, worker_id: str, session_id: str) -> tuple[str, str, int]:
        """The stream, byte counter and stripe a session's messages for the worker go to."""
        stripe = (await self.of(worker_id)).for_session(self.keys, session_id)
        return self.keys.inbox(worker_id, stripe), self.keys.inbox_bytes(worker_id, stripe), stripe


async def delete_worker_keys(
    client: Any, keys: KeySchema, worker_id: str, stripes: InboxStripes
) -> None:
    """A worker's registration, session set and every inbox stripe: one DEL per other
    stripe (each in its own slot), then one for the keys of its own tag, so a delete that
    fails half-way leaves the registration for the next try. The announcement stays (an
    id's stripes never change: `announce`)."""
    for stripe in stripes.stripes:
        if stripe:
            await client.delete(keys.inbox(worker_id, stripe), keys.inbox_bytes(worker_id, stripe))
    await client.delete(
        keys.worker(worker_id),
        keys.worker_sessions(worker_id),
        keys.inbox(worker_id),
        keys.inbox_bytes(worker_id),
    )


async def create_groups(
    client: Any, keys: KeySchema, worker_id: str, stripes: InboxStripes
) -> None:
    """Every stripe's stream and consumer group (`runners`), where they are missing."""
    for stripe in stripes.stripes:
        with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists
            await client.xgroup_create(
                keys.inbox(worker_id, stripe), INBOX_GROUP, id="0", mkstream=True
            )
