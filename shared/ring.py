"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam).

Workers sit on a hash ring at `vnodes` points each. A session goes to the
first worker clockwise from its own hash whose load is below
`ceil((1 + epsilon) * average)` (the average counting the new session) and
below its `max_sessions`. Adding or removing a worker moves only the keys that
must move; a pinned session never moves while its worker lives.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence

DEFAULT_VNODES = 100
DEFAULT_EPSILON = 0.25


def _hash(value: str) -> int:
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, worker_ids: Sequence[str], vnodes: int = DEFAULT_VNODES) -> None:
        points = sorted(
            (_hash(f"{worker_id}#{i}"), worker_id)
            for worker_id in worker_ids
            for i in range(vnodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [w for _, w in points]
        self.worker_ids = sorted(set(worker_ids))

    def walk(self, key: str) -> Iterator[str]:
        """Every worker once, clockwise from `key`'s position."""
        if not self._owners:
            return
        start = bisect.bisect(self._hashes, _hash(key))
        seen: set[str] = set()
        for offset in range(len(self._owners)):
            owner = self._owners[(start + offset) % len(self._owners)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.worker_ids):
                    return

    def first(self, key: str) -> str | None:
        return next(self.walk(key), None)


def load_bound(total_load: int, workers: int, epsilon: float = DEFAULT_EPSILON) -> int:
    """ceil((1 + epsilon) * average), the average counting the session being placed."""
    return math.ceil((1 + epsilon) * (total_load + 1) / max(workers, 1))


def bounded_order(
    ring: HashRing,
    key: str,
    loads: Mapping[str, int],
    capacities: Mapping[str, int],
    epsilon: float = DEFAULT_EPSILON,
) -> list[str]:
    """Workers to try for `key`, in order: clockwise ones under the load bound first,
    then any other with room (the workers are the final admission authority)."""
    bound = load_bound(sum(loads.get(w, 0) for w in ring.worker_ids), len(ring.worker_ids), epsilon)
    walk = list(ring.walk(key))
    has_room = [w for w in walk if loads.get(w, 0) < capacities.get(w, 0)]
    preferred = [w for w in has_room if loads.get(w, 0) < bound]
    return preferred + [w for w in has_room if w not in preferred]
