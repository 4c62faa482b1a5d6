"""How long the admin commands take to start, next to a bare interpreter, in one run.

    .venv/bin/python -m bench.cli_start [--runs 10]

Starts a real redis-server (empty), then times whole commands, each `runs` times, as
an operator types them:
  python -c pass                      the floor: an interpreter that does nothing
  duplex sessions ls                  an admin command (imports the Redis client and keys)
  duplex workers                      another
  python -c "import services.serve"   what every command imported before they were split
                                      off: the API, the worker and the wire codec
Prints median and min and the ratio of each median to the floor's, and writes them to
docs/operations.md (section cli_start).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import machine, now_utc, write_section
from harness.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
DUPLEX = str(Path(sys.executable).with_name("duplex"))


def commands() -> list[tuple[str, list[str]]]:
    return [
        ("`python -c pass`", [sys.executable, "-c", "pass"]),
        ("`duplex sessions ls`", [DUPLEX, "sessions", "ls"]),
        ("`duplex workers`", [DUPLEX, "workers"]),
        (
            '`python -c "import services.serve"` (the servers)',
            [sys.executable, "-c", "import services.serve"],
        ),
    ]


def time_command(argv: list[str], env: dict[str, str], runs: int) -> list[float]:
    subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, check=True)  # warm the caches
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, check=True)
        samples.append(time.perf_counter() - started)
    return samples


def main(args: argparse.Namespace) -> None:
    server = RedisServer()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
        env["DUPLEX_REDIS_URL"] = server.url
        rows = [(label, time_command(argv, env, args.runs)) for label, argv in commands()]
    finally:
        server.stop()
    floor = statistics.median(rows[0][1])
    lines = [
        f"Measured {now_utc()} on {machine()}:",
        f"`python -m bench.cli_start --runs {args.runs}` (an empty redis-server).",
        "",
        "| command | median | min | median / `python -c pass` |",
        "|---|---|---|---|",
    ]
    for label, samples in rows:
        median = statistics.median(samples)
        lines.append(
            f"| {label} | {median * 1000:.0f} ms | {min(samples) * 1000:.0f} ms "
            f"| {median / floor:.1f}x |"
        )
    table = "\n".join(lines)
    print(table)
    write_section("operations.md", "cli_start", table, "Admin command start time")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    main(parser.parse_args())
