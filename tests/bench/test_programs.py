"""Every benchmark program runs from its documented command and writes its section.

Tiny parameters, and DUPLEX_BENCH_DOCS pointing at a temporary folder so the repository's
docs keep the figures of a real run. The figures themselves are not asserted: tests must
pass on a slow machine; bench/ is where speed is judged.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RUNS = {
    "latency": (["--levels", "1,2", "--seconds", "0.5"], "benchmarks.md", ["img/latency.png"]),
    "capacity": (["--levels", "2", "--step-seconds", "1"], "benchmarks.md", ["img/capacity.png"]),
    "lifecycle": (["--runs", "2"], "benchmarks.md", []),
    "memory": (["--sessions", "20", "--full", "1"], "benchmarks.md", []),
    "redis_path": (["--opens", "3", "--events", "20"], "benchmarks.md", []),
    "cli_start": (["--runs", "1"], "operations.md", []),
    "cluster_bus": (
        ["--events", "50", "--sessions", "8", "--idle-seconds", "0.5", "--section", "cluster_bus"],
        "benchmarks.md",
        [],
    ),
    "tick_batched": (
        ["--levels", "1,2", "--seconds", "0.5", "--models", "echo"],
        "benchmarks.md",
        [],
    ),
    "inbox_codec": (["--iterations", "5", "--repeats", "1"], "benchmarks.md", []),
    # one run of its quickest scenario: a real cluster master killed under talking sessions
    "redis_failover": (["--runs", "1", "--scenarios", "cluster-left"], "benchmarks.md", []),
}


@pytest.mark.parametrize("program", sorted(RUNS))
def test_program_runs_and_writes_its_section(program, tmp_path):
    args, document, files = RUNS[program]
    env = {**os.environ, "DUPLEX_BENCH_DOCS": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{program}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    written = (tmp_path / document).read_text()
    assert f"<!-- BEGIN {program} -->" in written and "Measured" in written
    for name in files:
        assert (tmp_path / name).stat().st_size > 10_000  # a real PNG, not an empty file


@pytest.mark.parametrize(
    "program",
    [
        "latency",
        "capacity",
        "lifecycle",
        "memory",
        "redis_path",
        "cluster_bus",
        "faults",
        "profile",
        "chaos",
        "checkpoints",
        "fuzz",
        "exhaustion",
        "models",
        "tick_batched",
        "cli_start",
        "inbox_codec",
        "native_restore",
        "surface_cpu",
        "gpu_native",
        "nemotron_step",
        "minicpmo_step",
        "redis_failover",
    ],
)
def test_every_program_is_documented_and_has_help(program):
    docs = "".join(
        (ROOT / "docs" / name).read_text()
        for name in ("benchmarks.md", "reliability.md", "models.md", "operations.md")
    )
    assert f"bench/{program}.py" in docs
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{program}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "usage" in result.stdout, result.stderr
