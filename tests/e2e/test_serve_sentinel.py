"""`duplex serve --redis-sentinel`: one process on a Redis Sentinel set it starts itself (a
primary, a replica, three sentinels of the system's redis-server), for trying a failover on
a laptop. A turn with the openai SDK, the sentinels told to fail the primary over, and a
turn again once the replica is the primary; the set is gone after the process."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import redis

from harness.processes import start_serve
from tests.e2e.openai_turns import realtime_turn
from tests.e2e.waits import until

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

        with redis.Redis(port=sentinel) as ask:
            ask.execute_command("SENTINEL", "FAILOVER", "duplex")

            async def promoted() -> bool:
                _, port = ask.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", "duplex")
                return int(port) == int(replica)

            await until(promoted, lambda done: done, 60)
        with redis.Redis(port=int(replica)) as new_primary:
            assert new_primary.execute_command("ROLE")[0] in (b"master", "master")

        async def a_turn_completes() -> str:
            try:
                return (await realtime_turn(serve.base)).status
            except Exception as exc:  # refused while the pods reconnect: try again
                return repr(exc)

        await until(a_turn_completes, lambda status: status == "completed", 60)
    finally:
        assert serve.stop() == 0
    # the set's servers went with the process, and their directory
    for port in (primary, replica):
        with pytest.raises(redis.ConnectionError), redis.Redis(port=int(port)) as gone:
            gone.ping()
    assert not list(Path(tempfile.gettempdir()).glob(f"duplex-sentinel-*/redis-{primary}"))
