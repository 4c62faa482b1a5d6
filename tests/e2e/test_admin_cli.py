"""`duplex sessions` and `duplex workers` against a live cluster."""

import asyncio
import json
import os
import subprocess

from shared.client.duplex_client import DuplexClient
from tests.e2e.processes import DUPLEX


def duplex(cluster, *args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    env.update(DUPLEX_REDIS_URL=cluster.redis_url, DUPLEX_KEY_PREFIX=cluster.prefix)
    return subprocess.run(
        [DUPLEX, "--log-level", "WARNING", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


async def test_sessions_and_workers_commands(cluster):
    client = DuplexClient([cluster.apis[0].base], heartbeat_s=None)
    await client.connect({"extra_body": {"pace": 0}})
    try:
        await client.send({"type": "session.heartbeat"})
        await client.until("session.heartbeat_ack")
        run = asyncio.get_running_loop().run_in_executor
        listing = await run(None, duplex, cluster, "sessions", "ls")
        assert listing.returncode == 0 and client.session_id in listing.stdout
        records = [
            json.loads(line)
            for line in (
                await run(None, duplex, cluster, "sessions", "ls", "--json")
            ).stdout.splitlines()
        ]
        mine = next(r for r in records if r["session_id"] == client.session_id)
        assert (
            mine["state"] == "active"
            and mine["worker"] == "worker"
            and "resume_token_sha256" in mine
        )

        shown = await run(None, duplex, cluster, "sessions", "show", client.session_id)
        assert "attachment_generation" in shown.stdout and "session.heartbeat_ack" in shown.stdout

        tail = asyncio.create_task(
            asyncio.to_thread(
                duplex, cluster, "sessions", "tail", client.session_id, "--limit", "1"
            )
        )
        await asyncio.sleep(1.0)
        await client.send({"type": "session.heartbeat"})
        tailed = await tail
        assert json.loads(tailed.stdout.splitlines()[-1])["type"] == "session.heartbeat_ack"

        closed = await run(
            None, duplex, cluster, "sessions", "close", client.session_id, "--reason", "maintenance"
        )
        assert closed.returncode == 0
        event = (await client.until("session.closed"))[-1]
        assert event.reason == "maintenance"

        workers = await run(None, duplex, cluster, "workers", "--json")
        rows = [json.loads(line) for line in workers.stdout.splitlines()]
        assert any(r["worker_id"] == "worker" and r["model"] == "echo" for r in rows)
        missing = await run(None, duplex, cluster, "sessions", "show", "duplex-nope")
        assert missing.returncode == 1
    finally:
        await client.close(end_session=False)
