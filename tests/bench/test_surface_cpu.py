"""bench/surface_cpu.py runs from its documented command and writes its section.

Two clients for a couple of seconds per surface, into a temporary docs folder. What is
checked is the output's shape: a row per surface, each with the model's audio back and no
error, and the codec table. The figures themselves are not judged (bench/ is where speed
is judged, and the suite must pass on a slow machine).
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SURFACES = ("Moshi, Ogg Opus", "GPT-Live, JSON", "duplex, JSON")
TINY = ["--levels", "2", "--seconds", "2", "--warmup", "1", "--idle-seconds", "0.5"]


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.surface_cpu", *args, "--docs", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


def rows(section: str) -> dict[str, dict[str, str]]:
    """The figures table, by surface: each row's cells by their column's heading."""
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header = next(line for line in lines if line.startswith("| surface |"))
    names = [cell.strip() for cell in header.strip("|").split("|")]
    table = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == len(names) and cells[0].startswith(SURFACES):
            table[cells[0]] = dict(zip(names, cells, strict=True))
    return table


def test_a_tiny_run_writes_a_row_per_surface_with_audio_back(tmp_path):
    result = run(tmp_path, *TINY, "--codec-repeats", "1")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    written = (tmp_path / "benchmarks.md").read_text()
    begin, end = "<!-- BEGIN surface_cpu -->", "<!-- END surface_cpu -->"
    assert begin in written and end in written
    section = written[written.index(begin) : written.index(end)]
    assert "Measured" in section and "python -m bench.surface_cpu --levels 2" in section
    table = rows(section)
    assert len(table) == 3, section
    for surface, row in table.items():
        assert row["sessions"] == "2"
        assert float(row["audio back"]) > 0.3, (surface, row)  # the model spoke back
        assert float(row["words / session-s"]) > 0, (surface, row)  # and said "."
        assert float(row["up B / session-s"].replace(",", "")) > 0
        assert float(row["down B / session-s"].replace(",", "")) > 0
        assert float(row["pod CPU ms / session-s"]) >= 0
        assert row["errors"] == "0", (surface, row)
    # Opus is far smaller on the wire than base64 pcm16, whatever the machine's speed
    moshi = next(row for name, row in table.items() if name.startswith("Moshi"))
    duplex = next(row for name, row in table.items() if name.startswith("duplex"))
    assert float(moshi["up B / session-s"].replace(",", "")) < float(
        duplex["up B / session-s"].replace(",", "")
    )
    assert "| Opus: decode a client page (`OpusDecoder`) |" in section
    assert "| JSON: parse an append (orjson + base64) |" in section
    assert "Pod CPU per session-second over the duplex JSON floor's" in section


def test_it_is_documented_and_has_help():
    assert "bench/surface_cpu.py" in (ROOT / "docs" / "benchmarks.md").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "bench.surface_cpu", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "usage" in result.stdout, result.stderr
