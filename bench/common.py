"""What every benchmark program shares: a stack of real processes, statistics,
per-process CPU and memory readings from /proc, and writing a section of a doc.

The processes are the same ones the end-to-end tests start (`harness/processes.py`):
a real redis-server and real `duplex worker` / `duplex api` processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from harness.processes import HttpProcess, Process, start_api, start_worker
from harness.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
# where the programs write their sections and plots: the repository's docs/, or elsewhere
# (the suite's smoke runs of every program write to a temporary folder)
DOCS = Path(os.environ.get("DUPLEX_BENCH_DOCS") or ROOT / "docs")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def summary(samples: list[float]) -> dict[str, float]:
    """n, median, p99 and max of samples in seconds, reported in milliseconds."""
    ordered = sorted(samples)
    if not ordered:
        return {"n": 0, "median_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    return {
        "n": len(ordered),
        "median_ms": statistics.median(ordered) * 1000,
        "p99_ms": percentile(ordered, 0.99) * 1000,
        "max_ms": ordered[-1] * 1000,
    }


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def machine() -> str:
    cores = os.cpu_count()
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{cores} cores ({model}), {platform.machine()}, Python {platform.python_version()}"


def now_utc() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def commit(tree: Path = ROOT) -> str:
    """The commit of the checkout being measured (bench runs from a checkout), short."""
    try:
        return subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def dirty(paths: list[str], tree: Path = ROOT) -> str:
    """The uncommitted changes under `paths` of `tree` (the measured code may not be the
    commit's), comma-separated; "" for none."""
    try:
        out = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--", *paths],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return ", ".join(line[3:] for line in out.splitlines())


def add_output_arguments(parser: argparse.ArgumentParser, section: str) -> None:
    """--section/--label/--docs: the same program records another state of the code (say
    the commit before a change, run from a clone of it) under its own name, in any docs/."""
    parser.add_argument(
        "--section",
        default=section,
        help=f"the section (markers) to write, and the plot's name (default {section})",
    )
    parser.add_argument(
        "--label",
        default="",
        help='appended to a new section\'s heading, e.g. "before issue 18 (commit 2fd6518)"',
    )
    parser.add_argument(
        "--docs",
        type=Path,
        default=None,
        help=f"the docs directory to write into (default {DOCS})",
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class CpuMeter:
    """CPU used by named processes between `start()` and `read()`, as cores busy."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start: dict[str, float] = {}
        self._at = 0.0

    def start(self) -> None:
        self._start = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self._at = time.monotonic()

    def read(self) -> dict[str, float]:
        elapsed = time.monotonic() - self._at
        return {
            name: (cpu_seconds(pid) - self._start[name]) / elapsed
            for name, pid in self.pids.items()
        }


class Stack:
    """redis-server + workers + API pods, all real processes, stopped together."""

    def __init__(
        self,
        *,
        workers: int = 1,
        apis: int = 1,
        worker_env: dict[str, str] | None = None,
        api_env: dict[str, str] | None = None,
        redis: RedisServer | None = None,
        plugin: str = "echo",
    ) -> None:
        self.redis = redis or RedisServer()
        self.plugin = plugin
        self.prefix = f"bench-{uuid.uuid4().hex[:6]}"
        self.worker_env = dict(worker_env or {})
        self.api_env = dict(api_env or {})
        self.workers: list[Process] = [self.start_worker(f"worker-{i}") for i in range(workers)]
        self.apis: list[HttpProcess] = [self.start_api(f"api-{i}") for i in range(apis)]
        for api in self.apis:
            api.wait_ready()

    def start_worker(self, name: str) -> Process:
        return start_worker(self.redis.url, self.prefix, name, self.plugin, **self.worker_env)

    def start_api(self, name: str) -> HttpProcess:
        return start_api(self.redis.url, self.prefix, name, **self.api_env)

    def start_api_at(self, name: str, port: int) -> HttpProcess:
        """A restarted pod, back at its old address (as behind a Kubernetes Service)."""
        return start_api(self.redis.url, self.prefix, name, port=port, **self.api_env)

    @property
    def url(self) -> str:
        return self.redis.url

    def ws_bases(self) -> list[str]:
        return [f"ws://127.0.0.1:{api.port}" for api in self.apis]

    def redis_pid(self) -> int:
        return self.redis.process.pid

    def close(self) -> None:
        for process in [*self.apis, *self.workers]:
            process.stop()
        self.redis.stop()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_section(
    document: str, name: str, body: str, heading: str, docs: Path | None = None
) -> None:
    """Replace the text between `<!-- BEGIN name -->` and `<!-- END name -->` in
    docs/<document> (or `docs`/<document>); append a section with `heading` when the
    markers are missing."""
    path = (docs or DOCS) / document
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    text = path.read_text() if path.exists() else ""
    if begin not in text:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n{begin}\n{end}\n"
    start, stop = text.index(begin), text.index(end) + len(end)
    path.write_text(text[:start] + f"{begin}\n{body.strip()}\n{end}" + text[stop:])


@contextlib.asynccontextmanager
async def watchdog(seconds: float, label: str) -> AsyncIterator[None]:
    """If the block runs longer than `seconds`, print every asyncio task's stack to stderr
    (once): a stalled harness then says where it waits instead of just timing out."""

    async def bark() -> None:
        await asyncio.sleep(seconds)
        print(f"[{label}: still running after {seconds:.0f} s; tasks:]", file=sys.stderr)
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)
        sys.stderr.flush()

    dog = asyncio.create_task(bark())
    try:
        yield
    finally:
        dog.cancel()


@contextlib.contextmanager
def timed(label: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    print(f"[{label}: {time.monotonic() - started:.1f} s]", flush=True)
