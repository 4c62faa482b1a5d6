"""Consistent hashing with bounded loads: balance and stability."""

import collections
import uuid

from shared.ring import HashRing, bounded_order, load_bound

WORKERS = [f"worker-{i}" for i in range(10)]


def place(keys, workers, capacity=10**9, epsilon=0.25):
    ring = HashRing(workers)
    loads = collections.Counter({w: 0 for w in workers})
    placement = {}
    for key in keys:
        order = bounded_order(ring, key, loads, {w: capacity for w in workers}, epsilon)
        placement[key] = order[0]
        loads[order[0]] += 1
    return placement, loads


def test_balance_of_10k_sessions_over_10_workers_stays_within_the_bound():
    keys = [f"duplex-{uuid.UUID(int=i).hex}" for i in range(10_000)]
    _, loads = place(keys, WORKERS)
    average = 10_000 / 10
    assert max(loads.values()) <= load_bound(9_999, 10)  # ceil(1.25 * 1000) = 1250
    assert max(loads.values()) / average <= 1.25
    assert min(loads.values()) > 0


def test_removing_one_worker_moves_only_its_sessions():
    keys = [f"duplex-{uuid.UUID(int=i).hex}" for i in range(10_000)]
    before = HashRing(WORKERS)
    after = HashRing([w for w in WORKERS if w != "worker-3"])
    moved = [k for k in keys if before.first(k) != after.first(k)]
    assert moved and all(before.first(k) == "worker-3" for k in moved)
    # pinned sessions stay: re-placing only the removed worker's sessions changes nothing else
    placement, _ = place(keys, WORKERS)
    orphans = [k for k, w in placement.items() if w == "worker-3"]
    survivors = {k: w for k, w in placement.items() if w != "worker-3"}
    loads = collections.Counter(survivors.values())
    ring = HashRing([w for w in WORKERS if w != "worker-3"])
    for key in orphans:
        worker = bounded_order(ring, key, loads, dict.fromkeys(ring.worker_ids, 10**9))[0]
        loads[worker] += 1
    assert sum(loads.values()) == 10_000 and max(loads.values()) <= load_bound(9_999, 9)


def test_order_respects_capacity_and_walks_every_worker():
    ring = HashRing(["a", "b", "c"])
    order = bounded_order(ring, "s", {"a": 5, "b": 0, "c": 0}, {"a": 5, "b": 5, "c": 5})
    assert sorted(order) == ["b", "c"]  # a is full
    assert bounded_order(ring, "s", {"a": 5, "b": 5, "c": 5}, {"a": 5, "b": 5, "c": 5}) == []
    assert sorted(ring.walk("anything")) == ["a", "b", "c"]
    assert list(HashRing([]).walk("x")) == []
