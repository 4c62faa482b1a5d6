"""A Redis client: the real server at DUPLEX_REDIS_URL, a Sentinel-managed primary, a Redis
Cluster, or an embedded fakeredis.

URLs: `redis://host:port/db` (one Redis), `redis+sentinel://[user:password@]h1:26379,
h2:26379,h3:26379/<service>[/db][?sentinel_username=..&sentinel_password=..]` (the primary
that Redis Sentinel names for `<service>`, asked of the sentinels listed, followed across
failovers, promptly, by every pool: `sentinel_watch.py`; `rediss+sentinel://` for TLS to
the data nodes and the sentinels),
`redis+cluster://host:port` (a Redis Cluster, any node as the seed), or unset (embedded
fakeredis with Lua, for `duplex serve` only). redis-py has no Sentinel URL of its own: the
form is the one Pomerium, rq-dashboard and redis-sentinel-url use (the user and password are
the data nodes'; `sentinel_`-prefixed options are the sentinels' own credentials).

Every real client connects with a timeout and TCP keepalive, so a primary that vanished
without a reset (a partitioned host) is noticed in seconds rather than at the kernel's
two-hour default; no read timeout is set, because the pods' subscriptions and blocking
reads wait on purpose.

Live channels on a cluster are shard channels: SPUBLISH goes to the master that owns the
channel's slot and stays there (classic PUBLISH is copied to every node over the cluster
bus), and the API pod listens with SSUBSCRIBE on that master
(`shared/redis/sharded_pubsub.py`).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

import redis.asyncio as redis_async
from redis._parsers.commands import AsyncCommandsParser
from redis.asyncio.cluster import PRIMARY, ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.redis.sentinel_watch import FollowingPool, SentinelWatch

EMBEDDED = "embedded (fakeredis, in this process)"
CLUSTER_SCHEME = "redis+cluster://"
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
SENTINEL_PORT = 26379
#: a connect that takes longer is a Redis that is not there (a promoted replica answers in
#: milliseconds; a dead primary's address would otherwise hold a connect for minutes)
CONNECT_TIMEOUT_S = 2.0
#: TCP keepalive: a peer silent for 5 s is probed every second, dropped after 3 probes
KEEPALIVE = {
    option: value
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3))
    if (option := getattr(socket, name, None)) is not None
}
#: the options of every real client's connections
SOCKET_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": CONNECT_TIMEOUT_S,
    "socket_keepalive": True,
    "socket_keepalive_options": KEEPALIVE,
}


class RedisHandle:
    """The client plus a description for logs (never the password)."""

    def __init__(
        self,
        client: Any,
        description: str,
        server: Any = None,
        seed_url: str | None = None,
        sentinel: SentinelTarget | None = None,
        watch: SentinelWatch | None = None,
    ) -> None:
        self.client = client
        self.description = description
        self.server = server  # the FakeServer, for embedded mode
        self.seed_url = seed_url  # the cluster node it was given (for operators)
        self.sentinel = sentinel  # the Sentinel set and service, when the primary is theirs
        #: with Sentinel: the primary every pool of the handle follows (`sentinel_watch`)
        self.watch = watch
        self.cluster = isinstance(client, RedisCluster)
        #: the cluster clients of its own handed out (`reader_client`), closed with it
        self._own_clusters: list[RedisCluster] = []

    def client_of_its_own(self, redis_class: type) -> Any:
        """A client of `redis_class` (a `redis.asyncio.Redis` subclass: arq's) on a pool of
        its own, to the same Redis (one Redis, or the primary the sentinels name): for a
        library that closes the pool it is given when it stops (the pod's subscriptions run
        on the pod's). Not for a cluster, whose nodes a library must be told itself."""
        if self.sentinel is not None:
            return self._sentinel_manager().master_for(
                self.sentinel.service,
                redis_class=redis_class,
                connection_pool_class=FollowingPool,
                watch=self.watch,
                **self.sentinel.connection,
            )
        pool = self.new_client().connection_pool
        if self.server is None:
            pool = type(pool)(
                connection_class=pool.connection_class,
                max_connections=pool.max_connections,
                **pool.connection_kwargs,
            )
        return redis_class(connection_pool=pool)

    def new_client(self) -> Any:
        """Another connection to the same server (blocking reads get their own)."""
        if self.server is not None:
            import fakeredis

            return fakeredis.FakeAsyncRedis(server=self.server)
        return self.client

    def reader_client(self) -> Any:
        """A client for one loop of blocking reads (a worker's inbox stripe). On a cluster a
        cluster client of its own: redis-py's cluster client answers a lost node by closing
        every node's connections and reading the topology again, which fails every command
        in flight on the live masters too; a stripe's reader on a lost master must not
        break the reads of the other stripes, nor the process's other commands. Elsewhere
        the shared client (its pool gives each blocking read a connection of its own)."""
        if not self.cluster or self.seed_url is None:
            return self.new_client()
        known = [(node.host, node.port) for node in self.client.get_nodes()]
        client = cluster_client(self.seed_url, known)
        self._own_clusters.append(client)
        return client

    def pubsub_client(self) -> Any:
        """The client a `LiveHub` listens through: another connection to one Redis, or on
        a cluster the cluster client itself (the hub subscribes per shard from its nodes)."""
        if self.cluster:
            return self.client
        return self.new_client()

    async def publish(self, channel: str, data: bytes) -> int:
        """A message on a live channel (see `publish_live`)."""
        return await publish_live(self.client, channel, data)

    def _sentinel_manager(self) -> Sentinel:
        """The handle's one Sentinel manager: its connections to the sentinels are the
        handle's, closed with it (redis-py's Sentinel has no close of its own)."""
        assert self.sentinel is not None
        return self.client.connection_pool.sentinel_manager

    async def close(self) -> None:
        for own in self._own_clusters:
            await own.aclose()
        if self.watch is not None:
            await self.watch.stop()
        await self.client.aclose()
        if self.sentinel is not None:
            for sentinel in self._sentinel_manager().sentinels:
                await sentinel.aclose()


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


async def publish_live(client: Any, channel: str, data: bytes) -> int:
    """PUBLISH on one Redis; on a cluster SPUBLISH, which the cluster client sends to the
    owner of the channel's slot (it parses the channel as the key), so the message reaches
    that shard's subscribers and no other node."""
    if isinstance(client, RedisCluster):
        return int(await client.execute_command("SPUBLISH", channel, data))
    return int(await client.publish(channel, data))


def redact(url: str) -> str:
    """The URL without its secrets: the userinfo, and any `password` option's value."""
    if "?" in url:
        base, query = url.split("?", 1)
        options = [
            f"{name}=***" if name.endswith("password") else f"{name}={value}"
            for name, _, value in (option.partition("=") for option in query.split("&"))
        ]
        return redact(base) + "?" + "&".join(options)
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1) if "://" in url else ("redis", url)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


@dataclass(frozen=True)
class SentinelTarget:
    """A `redis+sentinel://` URL, parsed: the sentinels to ask, the service they name the
    primary of, and the options of the data nodes' and the sentinels' connections."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    #: the data nodes' connection options (db, credentials, TLS, timeouts)
    connection: dict[str, Any] = field(default_factory=dict)
    #: the sentinels' own (their credentials and TLS; redis-py gives them none otherwise)
    sentinel_options: dict[str, Any] = field(default_factory=dict)

    def manager(self) -> Sentinel:
        return Sentinel(list(self.sentinels), sentinel_kwargs=self.sentinel_options)

    def describe(self) -> str:
        host, port = self.sentinels[0]
        more = f",+{len(self.sentinels) - 1}" if len(self.sentinels) > 1 else ""
        return f"Redis via Sentinel {self.service!r} @ {host}:{port}{more}"


#: the options a Sentinel URL takes (anything else is refused: a typo is not ignored)
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


def parse_sentinel_url(url: str) -> SentinelTarget:
    """`redis+sentinel://[user:password@]host[:port][,host[:port]...]/service[/db][?...]`
    (ValueError for anything else). IPv6 hosts go in brackets; a port defaults to 26379."""
    scheme, rest = url.split("://", 1)
    tls = scheme == "rediss+sentinel"
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    connection: dict[str, Any] = {**SOCKET_OPTIONS, "health_check_interval": 10}
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        if user:
            connection["username"] = unquote(user)
        if password:
            connection["password"] = unquote(password)
    sentinels = tuple(_host_port(entry) for entry in netloc.split(",") if entry)
    if not sentinels:
        raise ValueError(f"{redact(url)}: name at least one sentinel (host:port)")
    parts = [unquote(part) for part in path.split("/") if part]
    if not parts or len(parts) > 2:
        raise ValueError(
            f"{redact(url)}: the path is /<service>[/<db>], the name the sentinels monitor "
            "the primary by"
        )
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError(f"{redact(url)}: the database must be a number, not {parts[1]!r}")
        connection["db"] = int(parts[1])
    sentinel_options: dict[str, Any] = dict(SOCKET_OPTIONS)
    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name not in SENTINEL_OPTIONS:
            raise ValueError(
                f"{redact(url)}: unknown option {name!r} (known: {', '.join(SENTINEL_OPTIONS)})"
            )
        sentinel_options[name.removeprefix("sentinel_")] = values[-1]
    if tls:
        connection["ssl"] = True
        sentinel_options["ssl"] = True
    return SentinelTarget(sentinels, parts[0], connection, sentinel_options)


def _host_port(entry: str) -> tuple[str, int]:
    if entry.startswith("["):  # [v6]:port
        host, _, port = entry[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = entry.rpartition(":") if ":" in entry else (entry, "", "")
    if not host:
        raise ValueError(f"not a sentinel address: {entry!r}")
    if port and not port.isdigit():
        raise ValueError(f"not a port: {port!r} in {entry!r}")
    return unquote(host), int(port) if port else SENTINEL_PORT


class AnyNodeCommandsParser(AsyncCommandsParser):
    """The cluster client's command table and key lookups, from whichever primary answers.

    redis-py's cluster client asks its default node (the first primary CLUSTER SLOTS lists)
    for the command table at every re-initialization, and that node for the keys of a
    command whose keys move (XREADGROUP, XREAD). With that one master lost, every command
    failed, for every shard, until a replica had taken over its slots: every session
    stalled, not only those whose keys were on it. The table does not change with the
    topology, so it is read once; a key lookup goes to the next primary when one is away."""

    def __init__(self, cluster: RedisCluster) -> None:
        super().__init__()
        self._cluster = cluster

    async def initialize(self, node: Any = None) -> None:
        if node is not None:
            self.node = node
        if not self.commands:
            await self._on_any_node(super().initialize)

    async def _get_moveable_keys(self, *args: Any) -> Any:
        lookup = super()._get_moveable_keys
        return await self._on_any_node(lambda: lookup(*args))

    async def _on_any_node(self, call: Any) -> Any:
        tried: set[str] = set()
        while True:
            try:
                return await call()
            except (RedisConnectionError, RedisTimeoutError):
                tried.add(self.node.name)
                others = [
                    node
                    for node in self._cluster.nodes_manager.nodes_cache.values()
                    if node.server_type == PRIMARY and node.name not in tried
                ]
                if not others:
                    raise
                self.node = others[0]


class StartupNodes(dict[str, Any]):
    """A cluster client's startup nodes, which it reads the topology from. redis-py 5.3.1
    forgets one on any connection error to it (`pop(name, None)`), including the errors its
    own re-initialisation causes: it closes every node's connections, failing the commands
    in flight on the live masters, whose nodes it then forgets too. With blocking reads in
    flight on every master, one master's loss made it forget them all, and it never
    connected again ("Redis Cluster cannot be connected. Please provide at least one
    reachable node: None"). Here a node a failure would forget is kept, where it is (the
    dict is not changed: another task may be iterating it to read the topology); a topology
    read (`pop(name)`, no default) still removes the nodes the cluster dropped."""

    def pop(self, key: str, *default: Any) -> Any:
        if default:
            return default[0]
        return super().pop(key)


def cluster_client(seed: str, known: Sequence[tuple[str, int]] = ()) -> RedisCluster:
    """A cluster client from a node's URL (`known`: other nodes to start from too)."""
    client = RedisCluster.from_url(seed, **SOCKET_OPTIONS)
    client.commands_parser = AnyNodeCommandsParser(client)
    nodes = client.nodes_manager
    startup = StartupNodes(nodes.startup_nodes)
    for host, port in known:
        node = ClusterNode(host, port, **nodes.connection_kwargs)
        startup.setdefault(node.name, node)
    nodes.startup_nodes = startup
    return client


def connect(url: str | None) -> RedisHandle:
    """Real Redis (a Sentinel-managed primary, a Redis Cluster) when `url` is set, else an
    embedded fakeredis server."""
    if url and url.startswith(CLUSTER_SCHEME):
        seed = "redis://" + url[len(CLUSTER_SCHEME) :]
        client = cluster_client(seed)
        return RedisHandle(client, f"Redis Cluster via {redact(seed)}", seed_url=seed)
    if url and url.startswith(SENTINEL_SCHEMES):
        target = parse_sentinel_url(url)
        manager = target.manager()
        watch = SentinelWatch(manager, target.service)
        client = manager.master_for(
            target.service, connection_pool_class=FollowingPool, watch=watch, **target.connection
        )
        return RedisHandle(client, target.describe(), sentinel=target, watch=watch)
    if url:
        client = redis_async.Redis.from_url(url, health_check_interval=10, **SOCKET_OPTIONS)
        return RedisHandle(client, redact(url))
    import fakeredis

    server = fakeredis.FakeServer()
    return RedisHandle(fakeredis.FakeAsyncRedis(server=server), EMBEDDED, server)
