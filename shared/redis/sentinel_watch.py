"""Following the primary that Redis Sentinel names, promptly, in every pool of a process.

redis-py's Sentinel pools ask the sentinels for the primary only when a connection
connects, and leave open connections where they are. A failover whose old primary stays up
(an operator's `SENTINEL FAILOVER`, or a primary cut off from the sentinels but not from
the pods) therefore left a process on both servers at once. Redis 7.0's old primary went
on taking writes for 11 s after its replica had been promoted, until the sentinels
demoted it and threw its data away. Meanwhile the process wrote heartbeats, events and
inbox entries there, while its new connections and the other processes read the new
primary. Within a second of a coordinated failover, the janitor (reading the new primary)
declared the live pod and worker dead, because their beats went to the old one, and closed
their sessions. A pod subscribed on the old primary missed the events published on the new
one, and a turn waited for ever.

`SentinelWatch` asks every sentinel twice a second which primary it names. It follows the
answer of the highest config epoch: the failover's leader bumps the epoch, so a sentinel
that has not heard of the failover yet still names the old primary under the old epoch,
and is not followed back. When the primary changes, every pool of the handle drops all of
its connections, those in use included (a blocking read, a subscription). Their commands
fail as in a short Redis outage, which the callers already retry, and they reconnect to
the new primary. What the old primary took before the watch saw the change is lost with
its data, as in any failover (docs/reliability.md says what the sessions make of it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

from redis.asyncio.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool
from redis.exceptions import RedisError

from shared.supervised import SupervisedLoop

log = logging.getLogger(__name__)

#: how often the sentinels are asked: writes to an old primary that stays up are lost for
#: at most about this long after the sentinels name its promoted replica
WATCH_PERIOD_S = 0.5
#: an answer older than this is asked again before a connection is made with it (the
#: watch's loop not running, or the sentinels not answering it)
FRESH_S = 2 * WATCH_PERIOD_S
#: a sentinel that has not answered in this long is left out of that look (a host
#: powered off, a frozen process): the others are not held up by it
ASK_TIMEOUT_S = 1.0
#: sentinels that name another primary under a lower config epoch than the one followed
#: are believed only after this long: they tell each other of a failover within seconds
#: (hello messages every 2 s), so a longer disagreement is a sentinel set deployed afresh
LOWER_EPOCH_FOLLOWED_AFTER_S = 30.0

Address = tuple[str, int]


class SentinelWatch:
    """The primary the sentinels name for `service`, kept current by a loop of its own
    (started by the first connection, stopped for good by `stop`)."""

    def __init__(self, manager: Sentinel, service: str) -> None:
        self.manager = manager
        self.service = service
        self.address: Address | None = None  # the primary connections go to
        self.epoch = -1  # its config epoch, as the sentinels said it
        self.down = False  # every sentinel that answered says the primary is down
        self.switches = 0  # how often the primary changed under this watch (diagnostics)
        self._before: Address | None = None  # the primary followed under an earlier epoch
        self._answered: float | None = None  # monotonic time of the last valid answer
        #: since when the sentinels name another primary under a lower epoch only
        self._lower_since: float | None = None
        self._looking: asyncio.Task[None] | None = None  # the look connects wait on
        self._stopped = False
        self._pools: weakref.WeakSet[FollowingPool] = weakref.WeakSet()
        self._loop = SupervisedLoop.every("sentinel-watch", WATCH_PERIOD_S, self.look)

    def follow(self, pool: FollowingPool) -> None:
        self._pools.add(pool)

    async def primary(self) -> Address:
        """Where to connect: the primary followed, asked again first when that answer is
        not fresh (none yet, or the sentinels have not answered for a while). Raises
        `MasterNotFoundError` (a ConnectionError) while the sentinels name none, or say it
        is down, as redis-py's own discovery does."""
        if not self._loop.running and not self._stopped:
            self._loop.start()
        if self._answered is None or time.monotonic() - self._answered > FRESH_S:
            # one look at a time: the connects that need one meanwhile wait on it
            if self._looking is None or self._looking.done():
                self._looking = asyncio.ensure_future(self.look())
            await asyncio.shield(self._looking)
        if self.address is None or self.down:
            raise MasterNotFoundError(f"No master found for {self.service!r}")
        return self.address

    async def look(self, now: float | None = None) -> None:
        """Ask every sentinel at once; follow the highest config epoch among the valid
        answers (a primary that is up, seen by enough sentinels: redis-py's own test)."""
        sentinels = list(self.manager.sentinels)  # redis-py reorders its list on discovery
        answers = await asyncio.gather(*(self._ask(sentinel) for sentinel in sentinels))
        now = time.monotonic() if now is None else now
        named: list[tuple[int, Address]] = []
        for state in answers:
            if state and self.manager.check_master_state(state, self.service):
                named.append((int(state["config-epoch"]), (state["ip"], int(state["port"]))))
        if not named:
            # answered, and none names a primary that is up: it is down (a failover to
            # come); nobody answered: what was followed stands until they do
            self.down = any(answers)
            return
        self.down = False
        self._answered = now
        epoch = max(epoch for epoch, _ in named)
        address = self._choose([address for e, address in named if e == epoch])
        if epoch < self.epoch and address != self.address:
            # Only sentinels that have not heard of the last failover answered (its leader
            # is away): stay. Unless they keep naming it for longer than a failover takes
            # to spread: a sentinel set deployed afresh, whose epochs start again at 0.
            if self._lower_since is None:
                self._lower_since = now
            if now - self._lower_since < LOWER_EPOCH_FOLLOWED_AFTER_S:
                return
        self._lower_since = None
        if epoch > self.epoch and self.address is not None:
            self._before = self.address
        previous, self.address, self.epoch = self.address, address, epoch
        if previous is not None and previous != address:
            await self._switch(previous)

    def _choose(self, candidates: list[Address]) -> Address:
        """The primary among those named under the highest epoch. The failover's leader
        names the old primary under the new epoch until it has switched (and the others
        follow it), so an address other than the one followed before that epoch is the
        newer answer; then the most named, then any, in a fixed order."""
        newer = [address for address in candidates if address != self._before] or candidates
        return max(set(newer), key=lambda address: (newer.count(address), address))

    async def _ask(self, sentinel: Any) -> dict[str, Any] | None:
        """A sentinel's state of the primary; None when it does not answer in time, or
        does not monitor the service."""
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                state = await sentinel.sentinel_master(self.service)
        except (RedisError, OSError, TimeoutError):
            return None
        return state if isinstance(state, dict) else None

    async def _switch(self, previous: Address) -> None:
        assert self.address is not None
        self.switches += 1
        pools = list(self._pools)
        log.warning(
            "Sentinel names a new primary for %r: %s:%d (config epoch %d), was %s:%d; "
            "%d connection pools drop every connection to the old one",
            self.service,
            *self.address,
            self.epoch,
            *previous,
            len(pools),
        )
        for pool in pools:
            pool.master_address = self.address
        # in use included: a connection left on the old primary would go on writing there,
        # and a subscription there hears nothing published on the new one
        await asyncio.gather(
            *(pool.disconnect(inuse_connections=True) for pool in pools),
            return_exceptions=True,
        )

    async def stop(self) -> None:
        self._stopped = True  # a pool that reconnects later does not start it again
        await self._loop.stop()
        if self._looking is not None:
            self._looking.cancel()
            await asyncio.gather(self._looking, return_exceptions=True)


class FollowingPool(SentinelConnectionPool):
    """A Sentinel pool whose connections connect to the primary its watch follows, and
    that the watch empties when the primary changes."""

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        self.watch: SentinelWatch = kwargs.pop("watch")
        super().__init__(service_name, sentinel_manager, **kwargs)
        self.watch.follow(self)

    async def get_master_address(self) -> Address:
        address = await self.watch.primary()
        self.master_address = address
        return address

    async def ensure_connection(self, connection: Any) -> None:
        """Every checkout: a connection that connected to the old primary while the watch
        switched (it had asked just before) is moved to the new one before it is used."""
        await super().ensure_connection(connection)
        address = self.watch.address
        if address is not None and (connection.host, int(connection.port)) != address:
            await connection.disconnect()
            await super().ensure_connection(connection)
