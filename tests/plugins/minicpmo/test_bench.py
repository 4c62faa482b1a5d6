"""bench/minicpmo_step.py runs from its documented command and writes its section, next to
the sections already there (a smoke run at tiny sizes into a temporary docs folder). Its
times are not asserted (tests must pass on a slow machine); what is: the tables have a row
for every slot count, series and history asked for, every restored slot stepped on as the
original (the program fails otherwise), and the record bytes a minute are what 16-bit
audio a second and a few tokens make."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

OTHER = "## Another program\n\n<!-- BEGIN other -->\nits figures\n<!-- END other -->\n"


def test_minicpmo_step_runs_and_writes_its_section(tmp_path):
    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n\n" + OTHER)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.minicpmo_step",
            "--quick",
            "--restore",
            "3,6",
            "--restore-camera",
            "3",
            "--check",
            "2",
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
    assert OTHER in written  # the other sections are left as they were
    assert written.count("<!-- BEGIN minicpmo_step -->") == 1
    section = written.split("<!-- BEGIN minicpmo_step -->")[1].split("<!-- END minicpmo_step -->")[
        0
    ]
    assert "Measured" in section and "-m bench.minicpmo_step --quick" in section

    # the step table: slots 1 and 2, audio only and with cameras
    steps = re.findall(
        r"^\| (\d) \| (\d) \| [\d.]+ / [\d.]+ ms \| \*\*[\d.]+\*\* \|", section, re.M
    )
    assert steps == [("1", "0"), ("2", "0"), ("1", "1"), ("2", "1")]

    # the records: 32,000 bytes of pcm16 a unit, a few tokens and codes, 4 bytes of length
    audio_only = re.search(r"^\| audio only \|.*\*\*([\d.]+) MB\*\*", section, re.M)
    camera = re.search(r"^\| a camera frame every unit \|.*\*\*([\d.]+) MB\*\*", section, re.M)
    assert audio_only and camera
    assert 1.92 <= float(audio_only.group(1)) <= 1.93
    assert float(camera.group(1)) > float(audio_only.group(1))

    # the restores asked for, each followed by units equal to the original's
    restores = re.findall(
        r"^\| [\d.]+ s \((\d+) units\) \| (no|every unit) \|.*\| (\d) of (\d) \|$", section, re.M
    )
    assert [(units, camera) for units, camera, _, _ in restores] == [
        ("3", "no"),
        ("6", "no"),
        ("3", "every unit"),
    ]
    assert all(equal == checked == "2" for _, _, equal, checked in restores)
