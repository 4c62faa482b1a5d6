"""A Redis Cluster master failing over under talking sessions, with real processes: two
`duplex api` pods and two `duplex worker`s (echo) on a `redis+cluster://` URL of a 3-master
cluster with a replica each (harness/redis_cluster.py; a 2 s node timeout, and
`cluster-require-full-coverage no`, so the live masters' slots stay served while the dead
master's replica is elected), and duplex-surface sessions taking echo turns while the master
that holds most sessions' keys is SIGKILLed.

No session may close; every session must talk again (a turn spoken after the kill is
answered) before a deadline; no client may see an event seq twice or going backwards. A turn
the pods refused while a master was gone is spoken again, as a user would (the talkers are
the Sentinel failover test's). The figures (kill to promotion, kill to each session talking
again, refused turns) and the processes' WARNING lines are printed (`pytest -s` shows them),
never asserted.

A worker's own keys (its registration, session set and stripe 0 of its inbox, under its
`{worker id}` tag) live on one master; its sessions' commands are on the inbox stripes of
their own keys' masters (shared/redis/inbox_stripes.py), so only the sessions whose keys
were on the killed master wait for the promotion. The printout says which worker's tag was
on the killed master. The second test kills that master, with no replica to take over:
the sessions whose keys are elsewhere must talk again while it stays away."""

from __future__ import annotations

import asyncio
import bisect
import collections
import re
import time
import uuid

from harness.processes import start_api, start_worker
from harness.recording_client import RecordingClient
from harness.redis_cluster import RedisClusterServers
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from tests.e2e.failover_figures import log_figures, record, seconds_after, session_figures
from tests.e2e.test_redis_failover import (
    Talker,
    count_lines,
    fleet_ready,
    sessions_talking,
    stop_talking,
    strictly_increasing,
    until,
)

SESSIONS = 6
WORKERS = 2
NODE_TIMEOUT_MS = 2000
#: kill to every session talking again, at most (a 2-core machine under load included)
RECOVERY_TIMEOUT_S = 60.0


def make_cluster() -> RedisClusterServers:
    return RedisClusterServers(
        masters=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS, full_coverage=False
    )


async def promoted(cluster: RedisClusterServers, replica: int, timeout_s: float) -> float | None:
    """When (monotonic) the replica at `replica` saw itself a master; None if not in time."""

    def is_master() -> bool:
        try:
            return cluster.roles(replica).get(replica, 0) is None
        except ConnectionError:
            return False

    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(is_master):
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.05)
    return time.monotonic()


def holes(client: RecordingClient) -> list[str]:
    """The seqs below the client's highest that it never received, less those a cancelled
    response explains (a pod drops a cancelled response's queued audio), each with what
    the client received around it."""
    sequenced = sorted(
        (f for f in client.delivered if "server_event_seq" in f),
        key=lambda f: f["server_event_seq"],
    )
    seqs = [f["server_event_seq"] for f in sequenced]
    statuses = {rid: status for rid, status, _ in client.done}
    found = []
    for seq in sorted(set(range(1, max(seqs, default=0) + 1)) - set(seqs)):
        at = bisect.bisect(seqs, seq)
        near = sequenced[max(at - 1, 0) : at + 1]
        responses = {f.get("response_id") for f in near if f.get("response_id")}
        if any(statuses.get(rid) == "cancelled" for rid in responses):
            continue
        around = [f"{f['server_event_seq']}:{f['type']}" for f in near]
        found.append(f"{seq} (between {around}, responses {[statuses.get(r) for r in responses]})")
    return found


def answers(talker: Talker) -> str:
    """What the client got: its events, the holes in their seqs, its responses' ends."""
    client = talker.client
    statuses = collections.Counter(status for _, status, _ in client.done)
    return (
        f"events {max(client.wire_seqs, default=0)}, holes {holes(client)[:3]},"
        f" responses {dict(statuses)}"
    )


def log_messages(log: str, level: str) -> collections.Counter[str]:
    """The log's lines of `level`, counted by message with their numbers and session ids
    blanked (one line per failover, per session or per retry reads the same)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in log.splitlines():
        if f" {level} " not in line:
            continue
        message = line.split(f" {level} ", 1)[1]
        message = re.sub(r"duplex-[0-9a-f]{32}", "<session>", message)
        message = re.sub(r"\d+(\.\d+)?", "N", message)
        counts[message[:200]] += 1
    return counts


def session_line(t: Talker, master: int, target: int, killed: float) -> str:
    """Where a session's keys are, and when it talked again after the kill."""
    again = t.talked_since(killed)
    return (
        f"  session {t.conversation.index}: keys on {master}"
        f"{' (killed)' if master == target else ''},"
        f" kill -> talks again {'never' if again is None else f'{again - killed:.2f} s'},"
        f" refused {t.refused}, unanswered {t.unanswered}"
    )


def print_warnings(kind: str, log: str) -> None:
    """The WARNING and ERROR lines of one kind of process, counted, and each message."""
    for level in ("WARNING", "ERROR"):
        messages = log_messages(log, level)
        lines = count_lines(log, f" {level} ")
        print(f"  {kind}: {lines} {level} lines, {len(messages)} distinct:")
        for message, count in messages.most_common():
            print(f"    {count:4d} x {message}")


async def test_cluster_master_killed_while_sessions_talk():
    cluster = await asyncio.to_thread(make_cluster)
    prefix = f"cfailover-{uuid.uuid4().hex[:6]}"
    keys = KeySchema(prefix)
    worker_ids = [f"w-{i}" for i in range(1, WORKERS + 1)]
    workers = [
        start_worker(cluster.url, prefix, name, DUPLEX_MAX_SESSIONS=str(SESSIONS))
        for name in worker_ids
    ]
    apis = [start_api(cluster.url, prefix, f"api-{i}") for i in range(2)]
    handle = connect(cluster.url)
    client = handle.client
    talkers: list[Talker] = []
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        await fleet_ready(client, keys, apis, workers)
        talkers, talking = await sessions_talking([api.base for api in apis], SESSIONS, stop, tasks)

        # where each session's keys and each worker's keys live, as the cluster says now
        session_ids = [t.client.session_id or "" for t in talkers]
        master_of = {sid: client.get_node_from_key(keys.session(sid)).port for sid in session_ids}
        worker_of = {
            sid: (await client.hget(keys.session(sid), "worker") or b"?").decode()
            for sid in session_ids
        }
        tag_master = {w: client.get_node_from_key(keys.inbox(w)).port for w in worker_ids}
        target, held = collections.Counter(master_of.values()).most_common(1)[0]
        [replica] = cluster.replicas_of(target)

        await asyncio.to_thread(cluster.kill, target)
        killed = time.monotonic()
        promoted_at = await promoted(cluster, replica, RECOVERY_TIMEOUT_S)
        recovered = await until(
            lambda: all(
                t.talked_since(killed) is not None or t.conversation.ended_by for t in talkers
            ),
            RECOVERY_TIMEOUT_S,
        )
        stop.set()
        await asyncio.gather(*talking)

        api_logs = "\n".join(api.logs() for api in apis)
        worker_logs = "\n".join(w.logs() for w in workers)
        print(
            f"\ncluster failover under {SESSIONS} talking sessions (3 masters + 3 replicas,"
            f" node timeout {NODE_TIMEOUT_MS} ms, full coverage no; 2 API pods, {WORKERS}"
            f" workers): killed master {target} held {held} sessions' keys"
        )
        print(
            "  kill -> replica promoted: "
            + ("never" if promoted_at is None else f"{promoted_at - killed:.2f} s")
        )
        print(
            "  worker tags: "
            + ", ".join(
                f"{w} on {port}{' (killed)' if port == target else ''}"
                for w, port in tag_master.items()
            )
        )
        for t, sid in zip(talkers, session_ids, strict=True):
            print(
                session_line(t, master_of[sid], target, killed)
                + f", worker {worker_of[sid]}, turns {t.conversation.turns},"
                f" resumes {t.client.resumes}, ended {t.conversation.ended_by}, {answers(t)}"
            )
        print_warnings("API pods", api_logs)
        print_warnings("workers", worker_logs)
        print(f"  Traceback lines {count_lines(api_logs + worker_logs, 'Traceback')}")

        record(
            "cluster",
            {
                "promoted_s": seconds_after(promoted_at, killed),
                "sessions": [
                    session_figures(
                        f"session {t.conversation.index}",
                        t,
                        killed,
                        keys_on_lost_master=master_of[sid] == target,
                        worker_keys_on_lost_master=tag_master.get(worker_of[sid]) == target,
                    )
                    for t, sid in zip(talkers, session_ids, strict=True)
                ],
                "logs": log_figures([*apis, *workers]),
            },
        )

        closed = {t.conversation.index: t.conversation.ended_by for t in talkers}
        assert all(reason is None for reason in closed.values()), str(closed)
        assert promoted_at is not None, f"the replica {replica} of {target} was never promoted"
        assert recovered, [(t.conversation.index, t.talked_since(killed)) for t in talkers]
        for t in talkers:
            seqs = t.client.wire_seqs
            assert strictly_increasing(seqs), (t.conversation.index, seqs)
    finally:
        await stop_talking(stop, tasks, talkers)
        for process in [*apis, *workers]:
            process.stop()
        await handle.close()
        await asyncio.to_thread(cluster.stop)


def keys_apart(client, master: int) -> KeySchema:
    """A key prefix whose shared keys (the worker and pod registries, the lease index, the
    janitor's queue) are on other masters than `master`."""
    while True:
        keys = KeySchema(f"stripes-{uuid.uuid4().hex[:6]}")
        shared = [keys.workers(), keys.apis(), keys.leases(), keys.arq_queue()]
        if all(client.get_node_from_key(key).port != master for key in shared):
            return keys


def worker_on(client, keys: KeySchema, master: int) -> str:
    """A worker id whose own keys (stripe 0 of its inbox, its registration) are on `master`."""
    return next(
        wid
        for wid in (f"w-{n}" for n in range(1000))
        if client.get_node_from_key(keys.worker(wid)).port == master
    )


async def test_a_master_holding_a_workers_own_keys_pauses_only_the_sessions_it_holds():
    """The master of a worker's own tag (its registration, stripe 0 of its inbox) is killed,
    and has no replica: it stays away. The worker's sessions whose keys are on the other
    masters go on talking (their commands are on their own masters' stripes, the worker's
    heartbeat reaches the registry on its own); those on the lost master wait for it."""
    cluster = await asyncio.to_thread(RedisClusterServers, 3, 0, NODE_TIMEOUT_MS, False)
    handle = connect(cluster.url)
    client = handle.client
    talkers: list[Talker] = []
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    processes = []
    try:
        await client.initialize()
        target = client.get_primaries()[0].port
        keys = keys_apart(client, target)
        worker_id = worker_on(client, keys, target)
        worker = start_worker(cluster.url, keys.prefix, worker_id, DUPLEX_MAX_SESSIONS="12")
        api = start_api(cluster.url, keys.prefix, "api-stripes")
        processes = [worker, api]
        await fleet_ready(client, keys, [api], [worker])
        talkers, talking = await sessions_talking([api.base], SESSIONS, stop, tasks)
        master_of = [
            client.get_node_from_key(keys.session(t.client.session_id or "")).port for t in talkers
        ]
        elsewhere = [t for t, master in zip(talkers, master_of, strict=True) if master != target]
        assert elsewhere, "every session's keys landed on the killed master: run again"

        await asyncio.to_thread(cluster.kill, target)
        killed = time.monotonic()
        talked = await until(
            lambda: all(t.talked_since(killed) is not None for t in elsewhere),
            RECOVERY_TIMEOUT_S,
        )
        stop.set()
        await asyncio.gather(*talking)

        print(
            f"\na master holding worker {worker_id}'s own keys killed (no replica; "
            f"{len(elsewhere)} of {SESSIONS} sessions' keys elsewhere):"
        )
        for t, master in zip(talkers, master_of, strict=True):
            print(session_line(t, master, target, killed))
        print_warnings("API pod", api.logs())
        print_warnings("worker", worker.logs())
        record(
            "cluster-left",
            {
                "sessions": [
                    session_figures(
                        f"session {t.conversation.index}",
                        t,
                        killed,
                        keys_on_lost_master=master == target,
                        worker_keys_on_lost_master=True,
                    )
                    for t, master in zip(talkers, master_of, strict=True)
                ],
                "logs": log_figures([api, worker]),
            },
        )

        assert talked, [
            (master, t.talked_since(killed)) for t, master in zip(talkers, master_of, strict=True)
        ]
        for t in elsewhere:
            assert t.conversation.ended_by is None, t.conversation.ended_by
            assert strictly_increasing(t.client.wire_seqs), t.client.wire_seqs
        # the worker's beat reached the registry all along: it was never declared dead
        assert "is dead" not in api.logs()
    finally:
        await stop_talking(stop, tasks, talkers)
        for process in processes:
            process.stop()
        await handle.close()
        await asyncio.to_thread(cluster.stop)
