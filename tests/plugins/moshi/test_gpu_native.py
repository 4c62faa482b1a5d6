"""bench/gpu_native.py runs end to end on the CPU with the tiny checkpoint.

The GPU sweep it exists for (a Moshi-7B-shaped model on an H200) cannot run here; this runs
the same path (the parts in their own processes, `MoshiFrameModel` on the real tick stage,
the restore and the stage's misses during one) with `--tiny --device cpu` at small levels
and few steps, and checks what it writes: the JSON's shape, every level stepped, the restore
rows and the stage's phases, the plot and the tables. No timing is asserted.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LEVELS = (1, 2)
RESTORES = (20, 70)


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_native", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-native")
    result = run(
        "--tiny",
        "--device",
        "cpu",
        "--levels",
        ",".join(map(str, LEVELS)),
        "--steps",
        "8",
        "--restore-frames",
        ",".join(map(str, RESTORES)),
        "--restore-busy",
        "2",
        "--stage-busy",
        "2",
        "--stage-history",
        "70",
        "--window-s",
        "0.3",
        "--chunk",
        "32",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout


def test_every_level_stepped_on_the_stage(output):
    out, _ = output
    report = json.loads((out / "gpu_native.json").read_text())
    assert report["program"] == "bench/gpu_native.py"
    assert report["cuda_graphs"]["modes"] == ["off"]  # CPU: no CUDA graphs, and said so
    assert any("CUDA graphs need CUDA" in note for note in report["notes"])
    assert [p["part"] for p in report["parts"]] == ["sweep:off", "restore"]
    assert all(p["returncode"] == 0 for p in report["parts"])
    assert report["model"]["shape"] == "tiny" and report["model"]["parameters"] > 0
    assert report["model"]["context_frames"] == 100
    assert report["device"]["device"] == "cpu" and "gpu" not in report["device"]
    levels = report["levels"]
    assert [(row["mode"], row["sessions"]) for row in levels] == [("off", n) for n in LEVELS]
    for row in levels:
        assert row["status"] == "ok", row
        assert row["ticks"] > 0 and row["step_failures"] == 0
        assert set(row["step_ms"]) == {"median", "p90", "p99", "max"}
        assert 0 < row["step_ms"]["median"] <= row["step_ms"]["p99"] <= row["step_ms"]["max"]
        assert row["frame_share"] > 0
        assert {"deadline_misses", "silence_frames", "input_frames_cut"} <= set(row)
        assert within_ticks(row["deadline_misses"], row["ticks"]), row
        assert row["graphs_enabled"] is False
        # on CPU the memory is the process's resident set, not the GPU's
        assert row["memory"]["kind"] == "rss" and row["memory"]["peak_rss_bytes"] > 0


def test_the_restore_rows_and_the_stage_during_one(output):
    out, stdout = output
    restore = json.loads((out / "gpu_native.json").read_text())["restore"]
    assert restore["status"] == "ok", restore
    assert restore["mode"] == "off" and restore["chunk_frames"] == 32
    assert [row["frames"] for row in restore["rows"]] == list(RESTORES)
    for row in restore["rows"]:
        assert row["replay_ms"] > 0 and row["chunks"] >= 1 and row["frames_per_s"] > 0
    stage = restore["stage"]
    assert stage["history_frames"] == 70 and stage["restored_frames"] == 70
    assert stage["busy"] == 2 and stage["chunks"] >= 1
    assert [p["name"] for p in stage["phases"]] == ["before", "during", "after"]
    for phase in stage["phases"]:
        assert phase["ticks"] > 0 and within_ticks(phase["deadline_misses"], phase["ticks"]), phase
    # the run's log says the same misses as its JSON
    misses = "/".join(str(p["deadline_misses"]) for p in stage["phases"])
    assert f"misses {misses} (before/during/after)" in stdout


def within_ticks(misses, ticks) -> bool:
    """A window's deadline misses: a count of its ticks that ended late (the stage counts a
    miss in the same step as the tick, at most one a tick), so an int from 0 to `ticks`."""
    return type(misses) is int and 0 <= misses <= ticks


def test_the_tables_and_the_plot_are_written(output):
    out, stdout = output
    assert (out / "gpu_native.png").stat().st_size > 10_000
    tables = (out / "gpu_native.md").read_text()
    assert "CPU, tiny checkpoint: not the H200 figure" in tables
    for sessions in LEVELS:
        assert f"| off | {sessions} | ok | " in tables
    for frames in RESTORES:
        assert f"\n| {frames} | " in tables
    assert "| during | " in tables
    assert "bench.gpu_native --tiny --device cpu" in tables
    assert tables.strip() in stdout


def test_an_earlier_run_renders_into_the_docs(output, tmp_path):
    """--from-json --write-docs: what a GPU machine sent back becomes the docs section."""
    out, _ = output
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text("# Benchmarks\n")
    result = run(
        "--from-json",
        str(out / "gpu_native.json"),
        "--out",
        str(tmp_path / "again"),
        "--write-docs",
        "--docs",
        str(docs),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    written = (docs / "benchmarks.md").read_text()
    assert "<!-- BEGIN gpu_native -->" in written and "<!-- END gpu_native -->" in written
    assert "img/gpu_native.png" in written and (docs / "img" / "gpu_native.png").exists()


def test_the_device_script_says_what_is_missing(tmp_path):
    """bench/gpu_native.sh without its wheels stops at once and says how to get them."""
    env = {**os.environ, "GPU_NATIVE_WHEELS": str(tmp_path / "none"), "OUT": str(tmp_path)}
    result = subprocess.run(
        ["bash", "bench/gpu_native.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "bench/gpu_native.sh fetch" in result.stderr and "carry" in result.stderr
