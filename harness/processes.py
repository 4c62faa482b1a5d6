"""Real `duplex` processes for the end-to-end tests and bench/: started, awaited ready, killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from harness.redis_server import free_port

DUPLEX = str(Path(sys.executable).with_name("duplex"))


class Process:
    def __init__(self, args: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.log = Path(tempfile.mkstemp(prefix=f"duplex-{name}-", suffix=".log")[1])
        environment = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
        environment.update(env)
        self.process = subprocess.Popen(
            [DUPLEX, *args], env=environment, stdout=self.log.open("wb"), stderr=subprocess.STDOUT
        )

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no goodbye, no detach (what a crashed pod does)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self, timeout: float = 15) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


class HttpProcess(Process):
    def __init__(self, args: list[str], env: dict[str, str], name: str, port: int) -> None:
        super().__init__(args, env, name)
        self.port = port
        self.base = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 60, headers: dict | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.logs()}")
            try:
                if (
                    httpx.get(f"{self.base}/health/ready", timeout=1, headers=headers).status_code
                    == 200
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout}s:\n{self.logs()}")


def wait_worker_ready(worker: Process, health_port: int, timeout: float = 120) -> None:
    """A worker's /health/ready on its health port: its model is loaded and it is
    registered (a model-loading worker takes a while; one that exits says why)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.process.poll() is not None:
            raise RuntimeError(f"worker exited early:\n{worker.logs()}")
        try:
            url = f"http://127.0.0.1:{health_port}/health/ready"
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"worker not ready after {timeout}s:\n{worker.logs()}")


def start_worker(
    redis_url: str, prefix: str, name: str = "worker", plugin: str = "echo", **env: str
) -> Process:
    environment = {"DUPLEX_REDIS_URL": redis_url, "DUPLEX_KEY_PREFIX": prefix, **env}
    return Process(["worker", "--plugin", plugin, "--worker-id", name], environment, name)


def start_api(
    redis_url: str, prefix: str, name: str = "api", port: int | None = None, **env: str
) -> HttpProcess:
    """An API pod; `port` lets a restarted pod come back at the same address."""
    port = port or free_port()
    environment = {"DUPLEX_REDIS_URL": redis_url, "DUPLEX_KEY_PREFIX": prefix, **env}
    return HttpProcess(["api", "--host", "127.0.0.1", "--port", str(port)], environment, name, port)


def start_serve(name: str = "serve", args: tuple[str, ...] = (), **env: str) -> HttpProcess:
    port = free_port()
    command = ["serve", "--host", "127.0.0.1", "--port", str(port), *args]
    return HttpProcess(command, dict(env), name, port)
