"""bench/native_failover.py runs from its documented command and writes its section: real
processes (redis-server, `duplex api`, two workers of a tiny model), a short talk, then the
moves (tiny runs into a temporary docs folder, with the model's venv: model_venvs.py). The
figures are checked to be there, not judged (bench/ judges them)."""

import os
import re
import subprocess
import sys

import pytest

from tests.bench.model_venvs import ROOT, python_for


def test_help_runs_in_the_main_venv():
    result = subprocess.run(
        [sys.executable, "-m", "bench.native_failover", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "--worker-tree" in result.stdout, result.stderr
    assert "bench/native_failover.py" in (ROOT / "docs" / "benchmarks.md").read_text()


# Moshi: both shapes, its workers started through --worker-tree (this checkout, by path);
# Nemotron: a failover only (a worker importing NeMo and loading takes a minute here)
RUNS = {
    "moshi": ["--shapes", "failover,drain", "--worker-tree", f"here={ROOT}"],
    "nemotron": ["--shapes", "failover"],
}


@pytest.mark.parametrize("model", sorted(RUNS))
def test_a_tiny_run_moves_a_session_and_writes_its_section(model, tmp_path):
    python = python_for(model)
    command = ["-m", "bench.native_failover", "--model", model, "--quick", *RUNS[model]]
    result = subprocess.run(
        [python, *command, "--docs", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=290,
    )
    # exit 1: a move after which the model never spoke
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    written = (tmp_path / "benchmarks.md").read_text()
    begin, end = f"<!-- BEGIN native_failover_{model} -->", f"<!-- END native_failover_{model} -->"
    section = written[written.index(begin) : written.index(end)]
    assert f"bench.native_failover --model {model} --quick" in section
    label = "here" if model == "moshi" else "this checkout"
    for shape in RUNS[model][1].split(","):
        # the move's row: seconds from the move to the model's voice, the new worker's
        # restore as its log line and the session hash's `restore` report say it
        row = re.search(
            rf"^\| {label} \([^)]*\) \| {shape} \| 3 s \| \d+ frames \| [\d.]+ s "
            r"\| \*\*([\d.]+) s\*\* \|.*\| (\d+) frames in [\d.]+ s.*"
            r"\| (\d+)/(\d+) in .*\| none \|$",
            section,
            re.M,
        )
        assert row, f"no {shape} row in:\n{section}"
        logged, replayed, frames = int(row[2]), int(row[3]), int(row[4])
        assert logged == replayed == frames > 0
