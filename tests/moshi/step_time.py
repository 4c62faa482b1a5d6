"""The tiny model's batched step time on CPU against the number of slots (not a test).

    .venv-moshi/bin/python -m tests.moshi.step_time [--frames 50] [--threads 1]

Builds the tiny checkpoint in a temporary directory, loads it through the plugin (greedy),
opens every slot and times `MoshiFrameModel.step` on noise-like audio; prints the median
and 95th percentile per slot count, against the 80 ms frame.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

from plugins.moshi import MoshiPlugin
from tests.moshi.tiny_moshi import make_tiny_moshi


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory = make_tiny_moshi(Path(scratch) / "tiny")
        options = {
            "model_dir": str(directory),
            "device": "cpu",
            "temperature": "0",
            "temperature_text": "0",
            "threads": str(args.threads),
        }
        plugin = MoshiPlugin.from_options(options)
        print(f"tiny Moshi on CPU, {args.threads} torch thread(s), {args.frames} frames")
        print("slots  median_ms  p95_ms  (frame: 80 ms)")
        rng = np.random.default_rng(0)
        for slots in args.slots:
            model = plugin.frame_model(slots)
            for slot in range(slots):
                model.open_slot(slot, {})
            active = np.ones(slots, dtype=bool)
            times = []
            for _ in range(args.frames):
                frames = (0.2 * rng.standard_normal((slots, model.frame_samples))).astype(
                    np.float32
                )
                started = time.perf_counter()
                model.step(frames, active)
                times.append((time.perf_counter() - started) * 1000)
            p95 = sorted(times)[int(0.95 * (len(times) - 1))]
            print(f"{slots:5d}  {statistics.median(times):9.1f}  {p95:6.1f}")


if __name__ == "__main__":
    main()
