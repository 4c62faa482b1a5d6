"""A 3-master Redis Cluster on loopback ports, made by the tests themselves (no external one)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


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


class RedisClusterServers:
    def __init__(self, masters: int = 3) -> None:
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise RuntimeError("redis-server/redis-cli are missing: `make test` installs them")
        self.dir = Path(tempfile.mkdtemp(prefix="duplex-cluster-"))
        self.ports = [free_cluster_port() for _ in range(masters)]
        self.processes = []
        for port in self.ports:
            node_dir = self.dir / str(port)
            node_dir.mkdir()
            self.processes.append(
                subprocess.Popen(
                    [
                        binary,
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(node_dir),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for port in self.ports:
            self._wait(cli, port)
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = subprocess.run(
                [cli, "-p", str(self.ports[0]), "cluster", "info"], capture_output=True, text=True
            )
            if "cluster_state:ok" in info.stdout:
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not become ready")

    @staticmethod
    def _wait(cli: str, port: int) -> None:
        for _ in range(100):
            if subprocess.run([cli, "-p", str(port), "ping"], capture_output=True).returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on {port} did not start")

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
