"""bench/nemotron_step.py runs from its documented command and writes its section (a smoke
run at tiny sizes into a temporary docs folder; its figures are not asserted: tests must
pass on a slow machine)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_nemotron_step_runs_and_writes_its_section(tmp_path):
    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.nemotron_step",
            "--quick",
            "--frames",
            "30",
            "--window",
            "3",
            "--restore",
            "10",
            "--docs",
            str(tmp_path),
        ],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    written = (tmp_path / "benchmarks.md").read_text()
    assert "<!-- BEGIN nemotron_step -->" in written and "Measured" in written
