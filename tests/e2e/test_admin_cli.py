"""`duplex sessions` and `duplex workers` against a live cluster."""

import asyncio
import json
import os
import subprocess

from harness.processes import DUPLEX
from shared.client.duplex_client import DuplexClient


def admin_env(cluster) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    env.update(DUPLEX_REDIS_URL=cluster.redis_url, DUPLEX_KEY_PREFIX=cluster.prefix)
    return env


def duplex(cluster, *args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DUPLEX, "--log-level", "WARNING", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=admin_env(cluster),
    )


async def start_tail(cluster, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        DUPLEX,
        "--log-level",
        "WARNING",
        "sessions",
        "tail",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=admin_env(cluster),
    )


async def read_event(tail: asyncio.subprocess.Process) -> dict:
    async with asyncio.timeout(20):
        line = await tail.stdout.readline()
    assert line, (await tail.stderr.read()).decode()
    return json.loads(line)


async def tail_follows_a_burst(cluster, client: DuplexClient) -> None:
    """`tail` prints the latest event of the idle session at once (the readiness the test
    waits for, whatever the CLI's start time), then all 200 events of a burst, in order."""
    tail = await start_tail(cluster, client.session_id, "-n", "1", "--limit", "201")
    try:
        latest = await read_event(tail)
        assert latest["type"] == "session.heartbeat_ack"
        assert latest["server_event_seq"] == client.last_seq  # the newest journaled event
        for n in range(200):  # back to back: no send waits for an ack
            await client.send({"type": "session.heartbeat", "event_id": f"burst-{n}"})
        burst = [await read_event(tail) for _ in range(200)]
        assert [e["type"] for e in burst] == ["session.heartbeat_ack"] * 200
        seqs = [e["server_event_seq"] for e in burst]
        assert seqs == list(range(latest["server_event_seq"] + 1, seqs[0] + 200))
        async with asyncio.timeout(20):
            assert await tail.wait() == 0  # --limit 201: the one at once and the burst
        for _ in range(200):
            await client.until("session.heartbeat_ack")
        assert client.last_seq == seqs[-1]  # the client got the same events
    finally:
        if tail.returncode is None:
            tail.kill()
            await tail.wait()


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

        await tail_follows_a_burst(cluster, client)

        closed = await run(
            None, duplex, cluster, "sessions", "close", client.session_id, "--reason", "maintenance"
        )
        assert closed.returncode == 0
        event = (await client.until("session.closed"))[-1]
        assert event.reason == "maintenance"
        ended = await run(None, duplex, cluster, "sessions", "tail", client.session_id, "-n", "1")
        assert ended.returncode == 0  # a closed session: its last event, then the end
        assert json.loads(ended.stdout)["type"] == "session.closed"
        assert ended.stderr == f"session {client.session_id} closed (maintenance)\n"

        workers = await run(None, duplex, cluster, "workers", "--json")
        rows = [json.loads(line) for line in workers.stdout.splitlines()]
        assert any(r["worker_id"] == "worker" and r["model"] == "echo" for r in rows)
        missing = await run(None, duplex, cluster, "sessions", "show", "duplex-nope")
        assert missing.returncode == 1
    finally:
        await client.close(end_session=False)
