"""`duplex serve --redis-sentinel`: one process on a Redis Sentinel set it starts itself (a
primary, a replica, three sentinels of the system's redis-server), for trying a failover on
a laptop. A turn with the openai SDK; then the sentinels are told to fail the primary over
while three clients take turns back to back, and a turn again once the replica is the
primary; the set is gone after the process.

`SENTINEL FAILOVER` leaves the old primary up and taking writes until the sentinels demote
it (11 s with Redis 7.0): the process must follow the sentinels at once, every connection
of it. Before it did, the janitor (reading the new primary) declared the live pod and worker
dead within a second, since their heartbeats still went to the old one, and closed their
sessions; and a turn whose session had been made on the old primary waited for ever. Every
turn must end: answered, or refused with an error or a closed socket the client sees (a
session made in the second before the sentinels named the new primary is lost with the
old one's data, and its client is told to start again)."""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest
import redis

from harness.processes import start_serve
from tests.e2e.openai_turns import realtime_turn
from tests.e2e.waits import until

#: a turn that has not ended after this long hangs (an echo turn takes well under a second)
TURN_HANG_S = 60

FOLLOWED_LINE = re.compile(r"^(\S+ \S+) WARNING \S+: Sentinel names a new primary", re.M)
SET_LINE = re.compile(
    r"primary 127\.0\.0\.1:(\d+), replica 127\.0\.0\.1:(\d+), sentinels ([\d, ]+) "
)


@pytest.mark.timeout(300)
async def test_serve_runs_on_its_own_sentinel_set_and_goes_on_after_a_failover():
    serve = start_serve("serve-sentinel", ("--redis-sentinel",))
    try:
        serve.wait_ready(timeout=120)
        logs = serve.logs()
        assert "Redis: Redis via Sentinel 'duplex'" in logs
        primary, replica, sentinels = SET_LINE.search(logs).groups()
        sentinel = int(sentinels.split(",")[0])
        assert (await realtime_turn(serve.base)).status == "completed"

        ends: list[str] = []
        demoted = asyncio.Event()  # the old primary is the new one's replica

        async def talk() -> None:
            """Turns back to back, through the whole time the old primary takes writes
            beside the new one, until one is answered after its demotion."""
            while True:
                after_demotion = demoted.is_set()
                try:
                    async with asyncio.timeout(TURN_HANG_S):  # a hang is the failure
                        ends.append((await realtime_turn(serve.base)).status)
                except TimeoutError:
                    raise AssertionError(f"a turn hung; the turns so far: {ends}") from None
                except Exception as exc:  # the socket closed on it, or it was refused
                    ends.append(type(exc).__name__)
                if after_demotion and ends[-1] == "completed":
                    return

        talkers = [asyncio.create_task(talk()) for _ in range(3)]
        try:
            with redis.Redis(port=sentinel) as ask:
                asked = time.time()
                ask.execute_command("SENTINEL", "FAILOVER", "duplex")

                async def promoted() -> bool:
                    _, port = ask.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", "duplex")
                    return int(port) == int(replica)

                await until(promoted, lambda done: done, 60)

            async def old_role() -> str:
                with redis.Redis(port=int(primary)) as old:
                    role = old.execute_command("ROLE")[0]
                return role.decode() if isinstance(role, bytes) else role

            await until(old_role, lambda role: role == "slave", 120)
            demoted.set()
            await asyncio.gather(*talkers)
        finally:  # a failed wait leaves no talker behind
            for talker in talkers:
                talker.cancel()

        followed = FOLLOWED_LINE.search(serve.logs())
        assert followed is not None, "the process never followed the sentinels"
        at = datetime.strptime(followed.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        print(  # figures for docs/reliability.md (pytest -s), never asserted
            f"followed the sentinels {at - asked:.2f} s after SENTINEL FAILOVER; "
            f"{len(ends)} turns through the failover, as they ended: "
            f"{dict(Counter(ends))}; the ends in order: {' '.join(end[:5] for end in ends)}"
        )
        with redis.Redis(port=int(replica)) as new_primary:
            assert new_primary.execute_command("ROLE")[0] in (b"master", "master")

        async def a_turn_completes() -> str:
            try:
                return (await realtime_turn(serve.base)).status
            except Exception as exc:  # refused while the pods reconnect: try again
                return repr(exc)

        await until(a_turn_completes, lambda status: status == "completed", 60)
        logs = serve.logs()
        # nobody was declared dead: every heartbeat reached the primary the janitor reads
        assert " is dead" not in logs, logs[-4000:]
    finally:
        assert serve.stop() == 0
    # the set's servers went with the process, and their directory
    for port in (primary, replica):
        with pytest.raises(redis.ConnectionError), redis.Redis(port=int(port)) as gone:
            gone.ping()
    assert not list(Path(tempfile.gettempdir()).glob(f"duplex-sentinel-*/redis-{primary}"))
