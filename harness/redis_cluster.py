"""A Redis Cluster on loopback ports, made by the tests themselves (no external one): 3
masters by default, optionally with replicas that take over a killed master's slots.

With replicas, `redis-cli --cluster create` decides which nodes become masters and which
replica follows which master; the roles are read back from `CLUSTER NODES` once every
replica's link to its master is up (`replicas`: replica port -> master port). Roles change
when a master dies and its replica is elected: `ports` and `replicas` say what the cluster
was made as, `roles()` says what it is now."""

from __future__ import annotations

import dataclasses
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

#: redis-server's own default: how long a node may be silent before it is failed
DEFAULT_NODE_TIMEOUT_MS = 15_000
READY_TIMEOUT_S = 30.0


def free_cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = random.randint(20_000, 50_000)
        try:
            for candidate in (port, port + 10_000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclasses.dataclass(frozen=True)
class ClusterNode:
    """One line of `CLUSTER NODES`."""

    node_id: str
    port: int
    role: str  # "master" | "replica"
    master_id: str | None  # a replica's master
    failed: bool  # flagged fail (or fail?, suspected) by the node that was asked


class RedisClusterServers:
    def __init__(
        self,
        masters: int = 3,
        replicas: int = 0,
        node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS,
        full_coverage: bool = True,
    ) -> None:
        """`replicas` per master; `full_coverage=False` keeps the slots of live masters
        served while a dead master's slots have no node (with the default, every node
        answers CLUSTERDOWN for all slots until a replica takes the dead master's)."""
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise RuntimeError("redis-server/redis-cli are missing: `make test` installs them")
        self.cli = cli
        self.dir = Path(tempfile.mkdtemp(prefix="duplex-cluster-"))
        started = [free_cluster_port() for _ in range(masters * (1 + replicas))]
        processes = {}
        for port in started:
            node_dir = self.dir / str(port)
            node_dir.mkdir()
            args = [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(node_timeout_ms),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(node_dir),
            ]
            if not full_coverage:
                args += ["--cluster-require-full-coverage", "no"]
            processes[port] = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        #: the nodes made masters, in start order (tests/redis/cluster_ops.py kills and
        #: restarts them by their index here, which is their process's index)
        self.ports = started
        #: replica port -> the port of the master it was made a replica of
        self.replicas: dict[int, int] = {}
        self.processes = list(processes.values())
        try:
            self._create(started, replicas)
        except BaseException:
            self.stop()
            raise
        if replicas:
            self.ports = [port for port in started if port not in self.replicas]
            self.processes = [processes[port] for port in [*self.ports, *self.replicas]]

    def _create(self, started: list[int], replicas: int) -> None:
        for port in started:
            self._wait(self.cli, port)
        nodes = [f"127.0.0.1:{port}" for port in started]
        create = [self.cli, "--cluster", "create", *nodes, "--cluster-replicas", str(replicas)]
        subprocess.run(
            [*create, "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self._poll(lambda: all(self._cluster_ok(port) for port in started), "cluster_state:ok")
        if replicas:
            self._poll(lambda: self._read_replicas(started, replicas), "every replica's link")

    # ------------------------------------------------------------ the cluster

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    @property
    def all_ports(self) -> list[int]:
        """Every node made here: the masters, then the replicas (their processes' order)."""
        return [*self.ports, *self.replicas]

    def replicas_of(self, master: int) -> list[int]:
        """The ports of the replicas made for the master at `master`."""
        return [replica for replica, of in self.replicas.items() if of == master]

    def process(self, port: int) -> subprocess.Popen[bytes]:
        return self.processes[self.all_ports.index(port)]

    def kill(self, port: int) -> None:
        """SIGKILL the node at `port` and wait for it to exit (what it had not yet sent its
        replica is lost)."""
        process = self.process(port)
        process.kill()
        process.wait(10)

    def nodes(self, port: int) -> list[ClusterNode]:
        """`CLUSTER NODES` as the node at `port` sees the cluster (raises if it does not
        answer)."""
        reply = self._ask(port, "cluster", "nodes")
        nodes = []
        for line in reply.splitlines():
            node_id, address, flags, master, *_ = line.split()
            flag_set = set(flags.split(","))
            nodes.append(
                ClusterNode(
                    node_id=node_id,
                    port=int(address.split("@")[0].rsplit(":", 1)[1]),
                    role="replica" if "slave" in flag_set else "master",
                    master_id=None if master == "-" else master,
                    failed=bool(flag_set & {"fail", "fail?"}),
                )
            )
        return nodes

    def roles(self, port: int) -> dict[int, int | None]:
        """What the node at `port` sees now: node port -> None for a master, its master's
        port for a replica (failed nodes included, as that node flags them)."""
        nodes = self.nodes(port)
        port_of = {node.node_id: node.port for node in nodes}
        return {
            node.port: None if node.role == "master" else port_of.get(node.master_id or "")
            for node in nodes
        }

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ helpers

    def _read_replicas(self, started: list[int], per_master: int) -> bool:
        """Every node's own CLUSTER NODES line names its role; done (and `replicas` set)
        once each master has its replicas and each replica's link is up, so a master
        killed from then on has a replica that can be elected."""
        replicas: dict[int, int] = {}
        for port in started:
            nodes = self.nodes(port)
            port_of = {node.node_id: node.port for node in nodes}
            [me] = [node for node in nodes if node.port == port]
            if me.role == "replica":
                info = self._ask(port, "info", "replication")
                if "master_link_status:up" not in info or me.master_id not in port_of:
                    return False
                replicas[port] = port_of[me.master_id]
        masters = [port for port in started if port not in replicas]
        counts = [sum(1 for of in replicas.values() if of == m) for m in masters]
        if any(count != per_master for count in counts):
            return False
        self.replicas = replicas
        return True

    def _cluster_ok(self, port: int) -> bool:
        return "cluster_state:ok" in self._ask(port, "cluster", "info")

    def _ask(self, port: int, *command: str) -> str:
        reply = subprocess.run(
            [self.cli, "-p", str(port), *command], capture_output=True, text=True, timeout=5
        )
        if reply.returncode != 0:
            raise ConnectionError(f"node {port}: {reply.stderr.strip()}")
        return reply.stdout

    def _poll(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                if ready():
                    return
            except (ConnectionError, subprocess.TimeoutExpired, ValueError):
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the cluster did not become ready: {what}")
            time.sleep(0.1)

    @staticmethod
    def _wait(cli: str, port: int) -> None:
        for _ in range(100):
            if subprocess.run([cli, "-p", str(port), "ping"], capture_output=True).returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on {port} did not start")
