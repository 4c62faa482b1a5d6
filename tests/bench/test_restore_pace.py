"""bench/restore_pace.py runs from its documented command, for each model, and writes its
section and plot (a tiny run into a temporary docs folder, with the model's venv:
tests/bench/model_venvs.py). Its figures are checked to be there, not judged: bench/ is
where speed is judged, and the suite must pass on a slow machine."""

import os
import re
import subprocess
import sys

import pytest

from tests.bench.model_venvs import ROOT, python_for


def test_help_runs_in_the_main_venv():
    result = subprocess.run(
        [sys.executable, "-m", "bench.restore_pace", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "--model" in result.stdout, result.stderr
    assert "bench/restore_pace.py" in (ROOT / "docs" / "benchmarks.md").read_text()


@pytest.mark.parametrize("model", ["moshi", "nemotron"])
def test_a_tiny_run_writes_its_section_and_plot(model, tmp_path):
    python = python_for(model)
    (tmp_path / "benchmarks.md").write_text(
        f"# Benchmarks\n\n<!-- BEGIN restore_pace_{model} -->\nOLD-FIGURES\n"
        f"<!-- END restore_pace_{model} -->\n\nkept\n"
    )
    result = subprocess.run(
        [
            python,
            "-m",
            "bench.restore_pace",
            "--model",
            model,
            "--quick",
            "--sizes",
            "14,20",
            "--window-ticks",
            "3",
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
    begin, end = f"<!-- BEGIN restore_pace_{model} -->", f"<!-- END restore_pace_{model} -->"
    assert written.count(begin) == 1 and "OLD-FIGURES" not in written and written.endswith("kept\n")
    section = written[written.index(begin) : written.index(end)]
    assert "Measured" in section and f"bench.restore_pace --model {model} --quick" in section
    # a row per size and shape: the failover-shaped history is a second (12 frames) shorter
    for frames, shape, replayed in [(14, "drain", 14), (14, "failover", 2), (20, "failover", 8)]:
        row = rf"^\| {frames} \(\d+ s\) \| {shape} \| {replayed} \| [\d.]+ s \| \*\*[\d.]+x\*\* \|"
        assert re.search(row, section, re.M), f"no {shape} row for {frames} in:\n{section}"
    # the deadline misses of each restore are counted against its ticks
    for misses, ticks in re.findall(r"\| (\d+) of (\d+) \|$", section, re.M):
        assert 0 <= int(misses) <= int(ticks)
    assert "estimate from arithmetic, not measured" in section
    assert (tmp_path / "img" / f"restore_pace_{model}.png").stat().st_size > 10_000
