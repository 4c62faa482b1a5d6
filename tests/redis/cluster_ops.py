"""Operations on a test Redis Cluster (`harness/redis_cluster.py`) that the sharded pub/sub
tests need: who owns a slot, a slot resharded to another master the way
`redis-cli --cluster reshard` does it, a master killed and started again on its port, a
replica added and promoted in its dead master's place."""

from __future__ import annotations

import asyncio
import subprocess

import redis.asyncio as redis_async

from harness.redis_cluster import RedisClusterServers, free_cluster_port
from shared.redis.slot_map import slot_of


def node(port: int) -> redis_async.Redis:
    return redis_async.Redis(host="127.0.0.1", port=port)


async def eventually(check, timeout_s: float = 20.0, what: str = "the condition") -> None:
    """Wait until `await check()` is true (something observable, never a fixed pause)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def slot_owner(servers: RedisClusterServers, slot: int) -> int:
    """The port of the master that owns `slot`, as the first node that answers says."""
    for port in servers.ports:
        client = node(port)
        try:
            for first, last, master, *_ in await client.execute_command("CLUSTER SLOTS"):
                if first <= slot <= last:
                    return int(master[1])
        except Exception:
            continue
        finally:
            await client.aclose()
    raise AssertionError(f"no node owns slot {slot}")


async def node_id(port: int) -> str:
    client = node(port)
    try:
        return (await client.execute_command("CLUSTER MYID")).decode()
    finally:
        await client.aclose()


async def shard_subscribers(port: int, channel: str) -> int:
    """How many clients of the node at `port` have SSUBSCRIBEd `channel`."""
    client = node(port)
    try:
        [(_, count)] = await client.execute_command("PUBSUB SHARDNUMSUB", channel)
        return int(count)
    finally:
        await client.aclose()


async def reshard(servers: RedisClusterServers, channel: str, target: int) -> None:
    """Move the slot of `channel` (and its keys) to the master at port `target`:
    IMPORTING on the target, MIGRATING on the source, MIGRATE of every key, then
    SETSLOT NODE on the target, the source and the other masters."""
    slot = slot_of(channel)
    source = await slot_owner(servers, slot)
    assert source != target
    source_id, target_id = await node_id(source), await node_id(target)
    src, dst = node(source), node(target)
    try:
        await dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        await src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        while keys := await src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
            await src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
        for port in [target, source, *(p for p in servers.ports if p not in (source, target))]:
            client = node(port)
            try:
                await client.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)
            finally:
                await client.aclose()
    finally:
        await src.aclose()
        await dst.aclose()


def kill(servers: RedisClusterServers, port: int) -> None:
    """SIGKILL the master at `port` (no goodbye on its connections' side but a reset)."""
    process = servers.processes[servers.ports.index(port)]
    process.kill()
    process.wait(10)


def restart(servers: RedisClusterServers, port: int) -> None:
    """Start the killed master again on its port, from its nodes.conf (same id, same slots)."""
    index = servers.ports.index(port)
    servers.processes[index] = subprocess.Popen(
        servers.processes[index].args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


async def cluster_ok(port: int) -> bool:
    client = node(port)
    try:
        info = await client.execute_command("CLUSTER INFO")
        return info.get("cluster_state") == "ok"
    except Exception:
        return False
    finally:
        await client.aclose()


async def add_replica(servers: RedisClusterServers, master: int) -> int:
    """A new node on a free port, joined as the replica of the master at port `master`
    (not in `servers.ports`, which lists masters; stopped with the others). Returns its port
    once its replication link is up."""
    port = free_cluster_port()
    node_dir = servers.dir / str(port)
    node_dir.mkdir()
    args = list(servers.processes[0].args)
    args[args.index("--port") + 1] = str(port)
    args[args.index("--dir") + 1] = str(node_dir)
    servers.processes.append(
        subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    )
    await eventually(lambda: _answers(port), what="the new node")
    subprocess.run(
        [
            "redis-cli",
            "--cluster",
            "add-node",
            f"127.0.0.1:{port}",
            f"127.0.0.1:{master}",
            "--cluster-slave",
            "--cluster-master-id",
            await node_id(master),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )

    async def replicating() -> bool:
        client = node(port)
        try:
            info = await client.info("replication")
            return info.get("role") == "slave" and info.get("master_link_status") == "up"
        finally:
            await client.aclose()

    await eventually(replicating, what="the replica's link to its master")
    return port


async def take_over(port: int) -> None:
    """The replica at `port` takes its (dead) master's slots: CLUSTER FAILOVER TAKEOVER."""
    client = node(port)
    try:
        await client.execute_command("CLUSTER FAILOVER", "TAKEOVER")
    finally:
        await client.aclose()


async def _answers(port: int) -> bool:
    client = node(port)
    try:
        return bool(await client.ping())
    except Exception:
        return False
    finally:
        await client.aclose()
