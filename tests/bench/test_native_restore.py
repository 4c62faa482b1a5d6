"""bench/native_restore.py runs from its documented command and writes its section.

It needs torch and kyutai's `moshi`: run with `.venv-moshi`'s python from any venv (skipped
where it is not installed: tests/bench/model_venvs.py). --quick sizes, into a temporary docs
folder; the figures are checked to be there, not judged (bench/ is where
speed is judged, and the suite must pass on a slow machine).
"""

import re
import subprocess

from tests.bench.model_venvs import ROOT, python_for


def test_quick_run_writes_the_native_restore_section(tmp_path):
    result = subprocess.run(
        [python_for("moshi"), "-m", "bench.native_restore", "--quick", "--docs", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    written = (tmp_path / "benchmarks.md").read_text()
    begin, end = "<!-- BEGIN native_restore -->", "<!-- END native_restore -->"
    assert begin in written and end in written
    section = written[written.index(begin) : written.index(end)]
    assert "Measured" in section and "bench.native_restore --quick" in section
    # the restore table: one row per --quick size, with its replay time and ratio
    for frames in (20, 120):
        row = re.search(
            rf"^\| {frames} \| \d+ s \| ([\d.]+) ms \| (\d+) \|.*\| (\d+)x \|$", section, re.M
        )
        assert row, f"no restore row for {frames} frames in:\n{section}"
        assert float(row.group(1)) > 0 and int(row.group(2)) >= 1
    # the stage's phases, each with its ticks and deadline misses
    for phase in ("before", "during", "after"):
        assert re.search(rf"^\| {phase} \| \d+ \| \d+ \| [\d.]+ / [\d.]+ ms \|$", section, re.M)
    assert "120 frames restored" in section
    # bytes per minute: the tiny model's (12-byte records) and Moshi-7B's computed 36 B
    assert "| 12 B | 750 | 9.0 KB |" in section
    assert "| 36 B | 750 | 27.0 KB |" in section


def test_it_reruns_into_the_same_section(tmp_path):
    """A second run replaces the section instead of adding one."""
    document = tmp_path / "benchmarks.md"
    document.write_text(
        "# Benchmarks\n\n## Old\n\n<!-- BEGIN native_restore -->\nold\n"
        "<!-- END native_restore -->\n\n## After\n\nkept\n"
    )
    result = subprocess.run(
        [
            python_for("moshi"),
            "-m",
            "bench.native_restore",
            "--quick",
            "--frames",
            "10",
            "--stage-history",
            "20",
            "--seconds",
            "0.1",
            "--docs",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    written = document.read_text()
    assert written.count("<!-- BEGIN native_restore -->") == 1
    assert "old" not in written and written.endswith("## After\n\nkept\n")
    assert re.search(r"^\| 10 \| ", written, re.M)
