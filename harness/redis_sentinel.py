"""A Redis Sentinel set on loopback ports, made by the tests themselves: a primary, one replica
and three sentinels that fail the primary over to the replica when it dies (what a
`redis+sentinel://` DUPLEX_REDIS_URL names in a deployment).

Every server runs from a config file of its own in the set's temporary directory, because
Sentinel rewrites configs: a sentinel writes what it learned (the replica, the other
sentinels, the current primary) into its own, and reconfigures a data node with
`REPLICAOF` + `CONFIG REWRITE`, which fails on a server started without a file.

The sentinels call a primary down after `DOWN_AFTER_MS` of silence; two of them (the
quorum) must agree before one of them promotes the replica. With one second, a killed
primary is replaced in a few seconds (`wait_promoted` says when; the tests print it).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import redis

from harness.redis_server import free_port

SERVICE = "duplex"
SENTINELS = 3
QUORUM = 2
#: silence after which a sentinel calls the primary down (subjectively; the quorum makes
#: it objective and starts the failover)
DOWN_AFTER_MS = 1000
#: how long a failover may take before another sentinel retries it
FAILOVER_TIMEOUT_MS = 10_000
#: how long starting the set may take: sentinels find each other through hello messages
#: they publish on the primary every 2 s
READY_TIMEOUT_S = 30.0
POLL_S = 0.05

T = TypeVar("T")


class RedisSentinelSet:
    def __init__(self, service: str = SERVICE) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            # the same message as harness/redis_server.py's
            raise RuntimeError(
                "redis-server is missing: `make test` installs it (apt-get install redis-server)"
            )
        self.binary = binary
        self.service = service
        self.dir = Path(tempfile.mkdtemp(prefix="duplex-sentinel-"))
        #: the data nodes (the primary and its replica, whichever is which now), by port
        self.servers: dict[int, subprocess.Popen[bytes]] = {}
        self.sentinels: dict[int, subprocess.Popen[bytes]] = {}
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    # ------------------------------------------------------------ start

    def _start(self) -> None:
        primary = self._start_server([])
        replica = self._start_server([f"replicaof 127.0.0.1 {primary}"])
        self._poll(
            lambda: _ask(replica, "INFO", "replication").get("master_link_status") == "up",
            READY_TIMEOUT_S,
            f"the replica on {replica} to sync with the primary on {primary}",
        )
        for _ in range(SENTINELS):
            port = free_port()
            directory = self._node_dir(f"sentinel-{port}")
            conf = self._write_conf(
                directory,
                port,
                [
                    f"sentinel monitor {self.service} 127.0.0.1 {primary} {QUORUM}",
                    f"sentinel down-after-milliseconds {self.service} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {self.service} {FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {self.service} 1",
                ],
            )
            self.sentinels[port] = self._spawn([str(conf), "--sentinel"])
        for port in self.sentinels:
            self._poll(
                lambda port=port: self._knows_the_set(port),
                READY_TIMEOUT_S,
                f"the sentinel on {port} to see the replica and the other sentinels",
            )

    def _node_dir(self, name: str) -> Path:
        directory = self.dir / name
        directory.mkdir()
        return directory

    def _write_conf(self, directory: Path, port: int, lines: list[str]) -> Path:
        conf = directory / "redis.conf"
        common = [
            f"port {port}",
            "bind 127.0.0.1",
            f'dir "{directory}"',
            f'logfile "{directory / "redis.log"}"',
        ]
        conf.write_text("\n".join([*common, *lines]) + "\n")
        return conf

    def _start_server(self, lines: list[str]) -> int:
        port = free_port()
        directory = self._node_dir(f"redis-{port}")
        conf = self._write_conf(directory, port, ['save ""', "appendonly no", *lines])
        self.servers[port] = self._spawn([str(conf)])
        self._poll(lambda: _ask(port, "PING"), 10, f"redis-server on {port} to start")
        return port

    def _spawn(self, arguments: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [self.binary, *arguments], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    # ------------------------------------------------------------ the set

    @property
    def url(self) -> str:
        sentinels = ",".join(f"127.0.0.1:{port}" for port in self.sentinels)
        return f"redis+sentinel://{sentinels}/{self.service}"

    def primary_port(self) -> int:
        """The primary's port, as the first sentinel that answers names it."""
        for port in self.sentinels:
            try:
                return self._named_by(port)
            except (redis.RedisError, OSError):
                continue
        raise RuntimeError(f"no sentinel answers for {self.service!r}")

    def replica_port(self) -> int:
        """The data node that is not the primary (it may be dead, after `kill_primary`)."""
        primary = self.primary_port()
        return next(port for port in self.servers if port != primary)

    def kill_primary(self) -> int:
        """SIGKILL the primary and wait for it to exit; returns its port. What it had not
        yet sent its replica is lost."""
        port = self.primary_port()
        process = self.servers[port]
        process.kill()
        process.wait(5)
        return port

    def wait_promoted(self, old_port: int, timeout_s: float = 30.0) -> int:
        """Wait until every sentinel names a primary other than `old_port` and that server
        answers ROLE master; returns its port."""

        def promoted() -> int | None:
            named = {self._named_by(port) for port in self.sentinels}
            if len(named) != 1 or old_port in named:
                return None
            [port] = named
            return port if _ask(port, "ROLE")[0] in (b"master", "master") else None

        return self._poll(
            promoted, timeout_s, f"the sentinels to promote a replica of the primary on {old_port}"
        )

    def stop(self) -> None:
        """Stop every server and sentinel (SIGKILL any that does not exit) and remove the
        set's directory."""
        processes = [*self.sentinels.values(), *self.servers.values()]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ helpers

    def _named_by(self, sentinel: int) -> int:
        _host, port = _ask(sentinel, "SENTINEL GET-MASTER-ADDR-BY-NAME", self.service)
        return int(port)

    def _knows_the_set(self, port: int) -> bool:
        state = _ask(port, "SENTINEL MASTER", self.service)
        return state["num-slaves"] == 1 and state["num-other-sentinels"] == SENTINELS - 1

    def _poll(self, check: Callable[[], T | None], timeout_s: float, what: str) -> T:
        """`check()` until it returns something true (a server not up yet, or refusing,
        counts as not yet), at most `timeout_s`; the logs' last lines if it never does."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = check()
                if result:
                    return result
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError(f"timed out waiting for {what}\n{self.log_tails()}")
            time.sleep(POLL_S)

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every server's and sentinel's log (for a failure's message)."""
        tails = []
        for log in sorted(self.dir.glob("*/redis.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {log.parent.name}\n" + "\n".join(text))
        return "\n".join(tails)


def _ask(port: int, *command: object) -> Any:
    """One command to the server or sentinel on `port`, on a connection of its own, closed
    after it (one to a server that is then killed must not linger); redis-py parses the
    reply as it does for its own methods (`SENTINEL MASTER` into a dict, INFO too)."""
    with redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1
    ) as client:
        return client.execute_command(*command)
