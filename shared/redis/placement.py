"""Which worker serves a session: the live workers of its model, in the order consistent
hashing with bounded loads gives (shared/ring.py). API pods place new sessions with it; a
draining worker and the dead-worker sweep place the sessions they move with it too."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from shared.redis.boundary import WorkerRegistration
from shared.redis.keys import KeySchema
from shared.ring import DEFAULT_EPSILON, HashRing, bounded_order


class WorkerDirectory:
    def __init__(
        self, client: Any, keys: KeySchema, heartbeat_ttl_s: float, epsilon: float = DEFAULT_EPSILON
    ) -> None:
        self.client = client
        self.keys = keys
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.epsilon = epsilon

    async def live_workers(self) -> list[WorkerRegistration]:
        since = int((time.time() - self.heartbeat_ttl_s) * 1000)
        ids = await self.client.zrangebyscore(self.keys.workers(), since, "+inf")
        if not ids:
            return []
        pipeline = self.client.pipeline(transaction=False)
        for worker_id in ids:
            pipeline.hgetall(self.keys.worker(worker_id.decode()))
        registrations = (
            WorkerRegistration.from_hash(worker_id.decode(), raw)
            for worker_id, raw in zip(ids, await pipeline.execute(), strict=True)
        )
        # a heartbeat whose hash is gone (or holds only a load update) places nothing
        return [registration for registration in registrations if registration is not None]

    async def models(self) -> list[str]:
        return sorted({worker.model for worker in await self.live_workers()})

    async def candidates(
        self, model: str | None, key: str = "", exclude: frozenset[str] = frozenset()
    ) -> list[WorkerRegistration]:
        """Workers that serve `model` (any model when None) and have room, in the order
        to try them for the session `key`. A draining worker takes nothing new, nor does
        a worker in `exclude` (the one a session is moving away from)."""
        workers = {
            w.worker_id: w
            for w in await self.live_workers()
            if (model is None or w.model == model) and not w.draining and w.worker_id not in exclude
        }
        ring = HashRing(sorted(workers))
        order = bounded_order(
            ring,
            key,
            {wid: w.active for wid, w in workers.items()},
            {wid: w.max_sessions for wid, w in workers.items()},
            self.epsilon,
        )
        return [workers[wid] for wid in order]

    async def first_with_room(
        self,
        model: str | None,
        key: str,
        exclude: frozenset[str],
        placed: Mapping[str, int],
    ) -> str | None:
        """The worker to move session `key` to: the first candidate with room, counting
        the sessions the caller has already `placed` on each (a worker reports its load
        only once it has restored them)."""
        for worker in await self.candidates(model, key, exclude=exclude):
            if worker.active + placed.get(worker.worker_id, 0) < worker.max_sessions:
                return worker.worker_id
        return None
