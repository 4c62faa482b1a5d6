"""A Redis Sentinel failover that loses writes the old primary acknowledged, on purpose, under
talking sessions, with real processes: two `duplex api` pods and a `duplex worker` (echo) on
a `redis+sentinel://` URL (harness/redis_sentinel.py).

The replica is cut off from the primary first: it is given credentials the primary does not
know (`masteruser`/`masterauth`) and the primary drops its replication link (`CLIENT KILL
TYPE replica`), so the replica's every try to sync again fails with WRONGPASS and its link
stays down. The sessions go on talking on the primary alone: their events are journaled
there and reach the clients, never the replica. Then the primary is SIGKILLed and the
sentinels promote the stale replica (its link has been down for far less than the
sentinels' limit, ten times their down-after time plus the time since the primary was
called down). The promoted primary's sessions are back at the seqs they had at the cut.

What the product promises, asserted: no client ever receives two events under one seq nor a
seq lower than one it has (each client's received seqs strictly increase over the whole
run); and each session either goes on without a hole (the worker's seq floor moved the
session's next_seq past every seq it handed out: `seq_regressions` >= 1 in the session's
hash) or its client was told `session.resync_required{journal_gap}`. The figures (events
lost from the journal, seq_regressions, resyncs, kill to promotion, kill to each session
talking again) are printed (`pytest -s`), never asserted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from harness.recording_client import RecordingClient, check
from tests.e2e.failover_figures import log_figures, record, seconds_after, session_figures
from tests.e2e.test_redis_cluster_failover import print_warnings
from tests.e2e.test_redis_failover import (
    SentinelFleet,
    Talker,
    sessions_talking,
    stop_talking,
    strictly_increasing,
    until,
)
from tests.redis.test_sentinel import direct, promotion

SESSIONS = 4
#: how long the sessions talk on the cut-off primary alone (a duration of load: the order
#: that matters, every session answered after the cut, is waited for on its own)
ALONE_S = 1.5
#: at most, since the sentinels promote no replica whose link has been down for longer than
#: ten times their down-after time (10 s here) plus the time since the primary went down
ALONE_MAX_S = 6.0
#: kill to every session talking again or told to resync, at most (a loaded 2-core machine)
RECOVERY_TIMEOUT_S = 60.0
RESYNC = "session.resync_required"


def resyncs_of(client: RecordingClient) -> list[str]:
    """The reasons of the session.resync_required events the client received (live), and
    of a resume the server refused with it."""
    reasons = [f.get("reason", "") for f in client.delivered if f.get("type") == RESYNC]
    if client.ended is not None and RESYNC in client.ended:
        reasons.append("journal_gap (on resume)")
    return reasons


def told_to_resync(talker: Talker) -> bool:
    return bool(resyncs_of(talker.client)) or RESYNC in (talker.conversation.ended_by or "")


async def test_writes_the_killed_primary_acknowledged_are_lost():
    fleet = await SentinelFleet.start("lost")
    sentinels, keys, worker, apis = fleet.sentinels, fleet.keys, fleet.worker, fleet.apis
    primary_port, replica_port = sentinels.primary_port(), sentinels.replica_port()
    primary, replica = direct(primary_port), direct(replica_port)
    talkers: list[Talker] = []
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        await fleet.ready()
        talkers, talking = await sessions_talking([api.base for api in apis], SESSIONS, stop, tasks)
        session_ids = [t.client.session_id or "" for t in talkers]

        # cut the replica off: its next sync is refused, for good
        await replica.config_set("masteruser", "duplex-cut-off")
        await replica.config_set("masterauth", "not-the-password")
        assert await primary.execute_command("CLIENT KILL TYPE replica") >= 1

        async def link_down() -> bool:
            info = await replica.info("replication")
            return info["master_link_status"] == "down"

        assert await until_async(link_down, 10), "the replica's link never went down"
        cut = time.monotonic()
        cut_offset = (await replica.info("replication"))["slave_repl_offset"]
        # the sessions talk on the primary alone: every one answers a turn after the cut
        assert await until(
            lambda: (
                time.monotonic() - cut >= ALONE_S
                and all(t.talked_since(cut) is not None for t in talkers)
            ),
            ALONE_MAX_S,
        ), [(t.conversation.index, t.talked_since(cut)) for t in talkers]
        # what the replica still holds: each session as it was at the cut
        stale = {
            sid: int(await replica.hget(keys.session(sid), "next_seq") or 0) for sid in session_ids
        }
        replica_info = await replica.info("replication")
        assert replica_info["master_link_status"] == "down", replica_info
        assert replica_info["slave_repl_offset"] == cut_offset, (cut_offset, replica_info)
        primary_offset = (await primary.info("replication"))["master_repl_offset"]

        old = await asyncio.to_thread(sentinels.kill_primary)
        killed = time.monotonic()
        held = [max(t.client.wire_seqs, default=0) for t in talkers]
        assert old == primary_port
        new, named_at = await promotion(sentinels, old)
        recovered = await until(
            lambda: all(
                t.talked_since(killed) is not None
                or told_to_resync(t)
                or t.conversation.ended_by is not None
                for t in talkers
            ),
            RECOVERY_TIMEOUT_S,
        )
        stop.set()
        await asyncio.gather(*talking)

        promoted = direct(new)
        try:
            metas = [
                {
                    k.decode(): v.decode()
                    for k, v in (await promoted.hgetall(keys.session(sid))).items()
                    if k in (b"next_seq", b"seq_regressions", b"journal_first_seq")
                }
                for sid in session_ids
            ]
        finally:
            await promoted.aclose()

        print(
            f"\nwrites lost on purpose: the replica cut off {killed - cut:.1f} s before the"
            f" kill ({primary_offset - cut_offset} replication bytes it never got),"
            f" {SESSIONS} talking sessions (2 API pods, 1 worker)"
        )
        print(f"  kill -> every sentinel names the promoted replica: {named_at - killed:.2f} s")
        sessions = []
        for t, sid, meta, at_kill in zip(talkers, session_ids, metas, held, strict=True):
            regressions = int(meta.get("seq_regressions", 0))
            # the floor the worker moved next_seq to: the last seq it was handed before the
            # kill (the journal starts over after it)
            floor = int(meta.get("journal_first_seq", 1)) - 1 if regressions else None
            lost = (floor if floor is not None else at_kill) - stale[sid]
            again = t.talked_since(killed)
            print(
                f"  session {t.conversation.index}: next_seq on the replica {stale[sid]},"
                f" client had {at_kill} at the kill, floor {floor}"
                f" -> {lost} journaled events lost; seq_regressions {regressions},"
                f" resyncs {resyncs_of(t.client)},"
                f" kill -> talks again {'never' if again is None else f'{again - killed:.2f} s'},"
                f" turns {t.conversation.turns}, refused {t.refused},"
                f" unanswered {t.unanswered}, resumes {t.client.resumes},"
                f" ended {t.conversation.ended_by}, check {check(t.conversation)}"
            )
            sessions.append(
                session_figures(
                    f"session {t.conversation.index}",
                    t,
                    killed,
                    journal_lost=lost,
                    seq_regressions=regressions,
                    resyncs=len(resyncs_of(t.client)),
                )
            )
        print_warnings("API pods", "\n".join(api.logs() for api in apis))
        print_warnings("worker", worker.logs())
        record(
            "lost-writes",
            {
                "promoted_s": seconds_after(named_at, killed),
                "sessions": sessions,
                "logs": log_figures([*apis, worker]),
            },
        )

        assert new == replica_port
        # the loss happened: every session had events past what the replica holds
        assert all(at_kill > stale[sid] for sid, at_kill in zip(session_ids, held, strict=True))
        assert recovered, [(t.conversation.index, t.talked_since(killed)) for t in talkers]
        for t, meta in zip(talkers, metas, strict=True):
            index, seqs = t.conversation.index, t.client.wire_seqs
            assert strictly_increasing(seqs), (index, seqs)
            if told_to_resync(t):
                assert set(resyncs_of(t.client)) <= {"journal_gap", "journal_gap (on resume)"}
                continue
            assert t.conversation.ended_by is None, (index, t.conversation.ended_by)
            assert int(meta.get("seq_regressions", 0)) >= 1, (index, meta)
            assert t.talked_since(killed) is not None, index
            outcome = check(t.conversation)
            assert outcome["lost"] == 0 and outcome["duplicated"] == 0, (index, outcome)
    finally:
        await stop_talking(stop, tasks, talkers)
        await primary.aclose()
        await replica.aclose()
        await fleet.stop()


async def until_async(condition: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    """Poll `await condition()` (a Redis server's observable state) until true or timed out."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True
