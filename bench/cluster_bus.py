"""Cluster-bus bytes per live event on a 3-master Redis Cluster: classic PUBLISH (before
issue 18) against SPUBLISH (after), measured in one run.

A classic PUBLISH is copied by the node that runs it to every other node over the cluster
bus (each copy a bus message: a ~2 KB header with the slot bitmap, then the payload), so any
node's SUBSCRIBE hears it; a SPUBLISH stays on the master that owns the channel's slot (and
its replicas: none here), where the API pod SSUBSCRIBEs. For each mode and payload size
the program publishes `--events` messages over `--sessions` live channels (spread over the
three masters' slots) the way the worker does: one publish per event, sent by the cluster
client to the owner of the channel's slot (the worker's publish script runs there), with
a subscriber as the API pod has one (classic: SUBSCRIBE on one node; sharded: the
product's `ShardedSubscriber`) that must hear every event. It reads:
  bus bytes   the bytes sent on every TCP connection of the cluster bus ports (port + 10000),
              from `ss -ti` (bytes_sent, each direction counted once, at its sender), less
              the idle bus traffic (pings) of a quiet window of the same length;
  bus msgs    CLUSTER INFO's cluster_stats_messages_sent summed over the nodes (pings too),
              and the publish / publishshard messages among them.

    .venv/bin/python -m bench.cluster_bus [--events 2000] [--sessions 64] [--sizes 200,7000]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import time

from bench.common import add_output_arguments, machine, now_utc, write_section
from harness.redis_cluster import RedisClusterServers
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from shared.redis.sharded_pubsub import ShardedSubscriber

KEYS = KeySchema("bench")
BYTES_SENT = re.compile(r"bytes_sent:(\d+)")


def bus_bytes(bus_ports: list[int]) -> dict[tuple[str, str], int]:
    """bytes_sent of every established connection that has a bus port at either end."""
    ports = " or ".join(f"sport = :{p} or dport = :{p}" for p in bus_ports)
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( {ports} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sockets: dict[tuple[str, str], int] = {}
    ends: tuple[str, str] | None = None
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 4 and not line.startswith(("\t", " ")):
            ends = (fields[2], fields[3])
        elif ends is not None and (match := BYTES_SENT.search(line)):
            sockets[ends] = int(match.group(1))
    return sockets


def sent_since(before: dict[tuple[str, str], int], after: dict[tuple[str, str], int]) -> int:
    return sum(sent - before.get(ends, 0) for ends, sent in after.items())


def bus_messages(ports: list[int]) -> dict[str, int]:
    """CLUSTER INFO's cluster_stats_messages_*_sent, summed over the nodes."""
    totals: dict[str, int] = {}
    for port in ports:
        info = subprocess.run(
            ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True
        ).stdout
        for line in info.splitlines():
            name, _, value = line.strip().partition(":")
            if name.startswith("cluster_stats_messages_") and name.endswith("_sent"):
                totals[name] = totals.get(name, 0) + int(value)
    return totals


class Listener:
    """The API pod's side: counts what it hears until it has heard `expected`."""

    def __init__(self) -> None:
        self.heard = 0
        self.expected = 0
        self.done = asyncio.Event()

    def hear(self, _channel: str, _data: bytes) -> None:
        self.heard += 1
        if self.heard >= self.expected:
            self.done.set()


async def classic_listener(servers: RedisClusterServers, channels: list[str], listener: Listener):
    import redis.asyncio as redis_async

    client = redis_async.Redis(host="127.0.0.1", port=servers.ports[0])
    pubsub = client.pubsub()
    await pubsub.subscribe(*channels)

    async def read() -> None:
        async for message in pubsub.listen():
            if message["type"] == "message":
                listener.hear(message["channel"], message["data"])

    return client, pubsub, asyncio.create_task(read())


async def run_mode(servers, handle, mode: str, size: int, events: int, channels: list[str]):
    listener = Listener()
    listener.expected = events
    if mode == "PUBLISH":
        client, pubsub, reader = await classic_listener(servers, channels, listener)
    else:
        subscriber = ShardedSubscriber.of_cluster(handle.client, listener.hear, lambda _c: None)
        await subscriber.start()
        for channel in channels:
            await subscriber.subscribe(channel)
    bus_ports = [p + 10_000 for p in servers.ports]
    payload = b"x" * size
    messages_before, bytes_before = bus_messages(servers.ports), bus_bytes(bus_ports)
    started = time.monotonic()
    for n in range(events):
        await handle.client.execute_command(mode, channels[n % len(channels)], payload)
    async with asyncio.timeout(60):
        await listener.done.wait()
    elapsed = time.monotonic() - started
    sent = sent_since(bytes_before, bus_bytes(bus_ports))
    messages_after = bus_messages(servers.ports)
    if mode == "PUBLISH":
        reader.cancel()
        await pubsub.aclose()
        await client.aclose()
    else:
        await subscriber.stop()
    delta = {k: v - messages_before.get(k, 0) for k, v in messages_after.items()}
    return sent, elapsed, delta, listener.heard


async def idle_rate(servers: RedisClusterServers, seconds: float) -> float:
    """Bus bytes per second with nothing published (the nodes' pings and pongs)."""
    bus_ports = [p + 10_000 for p in servers.ports]
    before = bus_bytes(bus_ports)
    await asyncio.sleep(seconds)
    return sent_since(before, bus_bytes(bus_ports)) / seconds


async def main(args: argparse.Namespace) -> None:
    servers = RedisClusterServers()
    handle = connect(servers.url)
    rows = []
    try:
        channels = [KEYS.live(f"bench-{n}") for n in range(args.sessions)]
        idle = await idle_rate(servers, args.idle_seconds)
        for size in args.sizes:
            for mode in ("PUBLISH", "SPUBLISH"):
                sent, elapsed, delta, heard = await run_mode(
                    servers, handle, mode, size, args.events, channels
                )
                per_event = max(0.0, sent - idle * elapsed) / args.events
                publishes = delta.get("cluster_stats_messages_publish_sent", 0) + delta.get(
                    "cluster_stats_messages_publishshard_sent", 0
                )
                rows.append(
                    (
                        mode,
                        size,
                        heard,
                        per_event,
                        delta.get("cluster_stats_messages_sent", 0) / args.events,
                        publishes / args.events,
                    )
                )
    finally:
        await handle.close()
        servers.stop()
    lines = [
        f"Measured {now_utc()} on {machine()}: a 3-master Redis Cluster (redis-server 7.0, no "
        f"replicas), {args.events} events per row over {args.sessions} live channels, "
        f"idle bus traffic {idle / 1000:.1f} kB/s subtracted. "
        "`.venv/bin/python -m bench.cluster_bus "
        f"--events {args.events} --sessions {args.sessions} "
        f"--sizes {','.join(map(str, args.sizes))}`",
        "",
        "| publish | payload (B) | heard by the API side | bus bytes / event | "
        "bus messages / event | publish messages / event |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, size, heard, per_event, messages, publishes in rows:
        lines.append(
            f"| {mode} | {size} | {heard} | {per_event:,.0f} | {messages:.2f} | {publishes:.2f} |"
        )
    overheads = [
        per_event / publishes - size
        for mode, size, _, per_event, _, publishes in rows
        if mode == "PUBLISH" and publishes
    ]
    if overheads:
        lines += [
            "",
            f"A classic PUBLISH is copied to each other master: {len(servers.ports) - 1} bus "
            f"messages per event, each about {sum(overheads) / len(overheads):,.0f} B more "
            "than its payload (the bus header with its 2 KB slot bitmap, and the channel). A "
            "SPUBLISH stays on the master that owns the slot: nothing crosses the bus with no "
            "replicas (with replicas, one copy per replica of that master only).",
        ]
    table = "\n".join(lines)
    print(table)
    heading = "Cluster-bus bytes per live event (`bench/cluster_bus.py`)" + (
        f", {args.label}" if args.label else ""
    )
    write_section("benchmarks.md", args.section, table, heading, args.docs)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument(
        "--sizes",
        type=lambda text: [int(s) for s in text.split(",")],
        default=[200, 7000],
        help="payload sizes in bytes (7000: a 100 ms audio delta)",
    )
    parser.add_argument("--idle-seconds", type=float, default=2.0)
    add_output_arguments(parser, "cluster-bus")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
