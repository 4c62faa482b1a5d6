"""The API pod's heartbeat, and taking its sessions back after it was declared dead.

Every pod's janitor sweeps the pods whose heartbeat is older than the TTL: their sessions
enter disconnect grace so their clients can resume elsewhere (services/api/janitor.py).
A pod that was not dead but stalled (its event loop held by one handler for longer than
the TTL) comes back with its sockets still attached to sessions that Redis now counts as
detached: nothing would reactivate them, and each would be expired at the end of its grace
while its client is still talking.

So the pod keeps the attachment generation of every session it holds a socket for, and
when its heartbeat finds that it had been removed from the registry (ZADD adds the member
again instead of updating its score) or that its previous beat is older than the TTL (a
sweep may be under way), it touches each of those sessions with its generation:
`lease_touch.lua` makes a session a sweep detached active again when that generation
still holds it (a resume elsewhere meanwhile has moved it on, or its own socket left,
and then nothing happens), and the pod indexes the session under itself again for the
next sweep. A reclaim that fails is tried again at the next beat.

Each beat also reads the workers' set and ticks `steady` (a `SteadyRedis`): the janitor,
whichever pod runs its sweep, judges heartbeats only once its pod's beats have gone through
without a gap for a TTL, so that Redis failing over never has a worker or pod declared dead
for the beats it could not take.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shared.redis.keys import KeySchema
from shared.redis.store import TOUCH_REACTIVATED, SessionStore
from shared.supervised import SupervisedLoop

#: beats further apart than this are an outage (they come every heartbeat interval, 1 s)
BEAT_GAP_S = 3.0


class SteadyRedis:
    """Since when Redis has answered without a gap (`tick` at each answered round of
    reads, every second): heartbeats are judged (`judging`) only once that is a TTL, so
    every worker and pod has had a TTL of a working Redis to beat in. The first tick, or
    the first after a gap (an outage: nothing ticks while Redis is away), starts the
    count again."""

    def __init__(self, ttl_s: float, gap_s: float = BEAT_GAP_S) -> None:
        self.ttl_s = ttl_s
        self.gap_s = gap_s
        self._since: float | None = None
        self._last: float | None = None
        self.waited = 0  # judgements not made, for tests and diagnostics

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last is None or now - self._last > self.gap_s:
            self._since = now
        self._last = now

    def judging(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        steady = (
            self._since is not None
            and self._last is not None
            and now - self._last <= self.gap_s
            and now - self._since >= self.ttl_s
        )
        self.waited += not steady
        return steady


log = logging.getLogger(__name__)


class PodLiveness:
    def __init__(
        self,
        client: Any,
        keys: KeySchema,
        store: SessionStore,
        pod_id: str,
        interval_s: float,
        ttl_s: float,
    ) -> None:
        self.client = client
        self.keys = keys
        self.store = store
        self.pod_id = pod_id
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        #: ticked by every beat: the pod's janitor judges heartbeats by it
        self.steady = SteadyRedis(ttl_s, gap_s=max(BEAT_GAP_S, 3 * interval_s))
        self._last_beat: float | None = None  # monotonic time of the last beat Redis took
        self._reclaim_pending = False
        self._attached: dict[str, int] = {}  # session id -> attachment generation held here
        # a beat that fails is logged and tried again after the loop's backoff pause
        self._loop = SupervisedLoop.every("api-heartbeat", interval_s, self.beat)
        self._registered = False  # the first beat adds the pod: nothing to take back
        self.reclaims = 0  # diagnostics: how often the pod found itself declared dead

    # ------------------------------------------------------------ attachments

    def attach(self, session_id: str, attachment_generation: int) -> None:
        self._attached[session_id] = attachment_generation

    def release(self, session_id: str, attachment_generation: int) -> None:
        if self._attached.get(session_id) == attachment_generation:
            del self._attached[session_id]

    @property
    def attached(self) -> dict[str, int]:
        return dict(self._attached)

    # ------------------------------------------------------------ heartbeat

    async def start(self) -> None:
        await self.beat()
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def beat(self) -> None:
        now = time.monotonic()
        # silent for longer than the TTL: another pod may be sweeping us right now
        stalled = self._last_beat is not None and now - self._last_beat > self.ttl_s
        added = await self.client.zadd(self.keys.apis(), {self.pod_id: int(time.time() * 1000)})
        await self.client.zcard(self.keys.workers())  # the set the worker sweep reads
        self.steady.tick()
        self._last_beat = now
        if self._registered and (added or stalled):
            self._reclaim_pending = True  # until one reclaim has gone all the way through
        self._registered = True
        if self._reclaim_pending:
            await self.reclaim()
            self._reclaim_pending = False

    async def reclaim(self) -> int:
        """Take back the sessions this pod still holds sockets for; returns how many a
        sweep had detached and are active again."""
        self.reclaims += 1
        attached = self.attached
        if attached:
            await self.client.sadd(self.keys.api_sessions(self.pod_id), *attached)
        taken_back = 0
        for session_id, generation in attached.items():
            if self._attached.get(session_id) != generation:
                continue  # its socket went meanwhile: its own detach stands
            touched = await self.store.touch(session_id, generation, self.pod_id)
            taken_back += touched == TOUCH_REACTIVATED
        log.warning(
            "API pod %s had been declared dead: %d of its %d sessions taken back from "
            "disconnect grace",
            self.pod_id,
            taken_back,
            len(attached),
        )
        return taken_back
