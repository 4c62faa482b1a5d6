"""`duplex serve --plugin minicpmo` on the tiny MiniCPM-o checkpoint, for the suites that run
MiniCPM-o's users' clients against it from the main venv (tests/seed_client,
tests/map_client): the server and the checkpoint's builder run with .venv-minicpmo's python
(torch and transformers live there, not in the main venv), greedy, with the CPU's stand-in
vocoder; and `HistoryWatcher`, which reads what the model kept of each session (its unit
records in Redis) while a client program runs.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from unittest import mock

import redis

from harness import processes
from harness.processes import HttpProcess, start_serve
from plugins.minicpmo.records import UnitRecord
from shared.contracts import split_records

ROOT = Path(__file__).resolve().parents[1]
#: what `make .venv-minicpmo/.installed` builds
DEFAULT_PYTHON = ROOT / ".venv-minicpmo" / "bin" / "python"
#: the served model's name
MODEL = "minicpmo"
#: greedy decoding (reproducible runs), one torch thread; the CPU's vocoder (tone) by default
OPTIONS = ("decode=greedy", "threads=1")
#: the largest record MiniCPM-o writes (plugins/minicpmo/frame_model.py's MAX_RECORD_BYTES:
#: a speaking unit's fixed part and one camera frame of at most 2 MiB)
MAX_RECORD_BYTES = 32_134 + 4 + 2 * 1024 * 1024

BUILD = """
import sys
from pathlib import Path
from plugins.minicpmo.builder import build_tiny_checkpoint
build_tiny_checkpoint(Path(sys.argv[1]), seed=0)
"""


def minicpmo_python(variable: str) -> Path | None:
    """.venv-minicpmo's python (the environment `variable` may name another), or None."""
    python = Path(os.environ.get(variable) or DEFAULT_PYTHON)
    return python if python.exists() else None


def build_checkpoint(python: Path, directory: Path) -> Path:
    """The tiny checkpoint (seed 0) written to `directory` by that venv's builder."""
    made = subprocess.run(
        [str(python), "-c", BUILD, str(directory)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if made.returncode != 0:
        raise RuntimeError(f"the tiny MiniCPM-o checkpoint was not built:\n{made.stderr[-4000:]}")
    return directory


def start_minicpmo_serve(
    python: Path, checkpoint: Path, name: str, args: tuple[str, ...] = (), **env: str
) -> HttpProcess:
    """`duplex serve --plugin minicpmo` from that venv (the `duplex` beside its python), on
    the tiny checkpoint; `args` and `env` are the server's own (sessions, keys, Redis)."""
    options: list[str] = []
    for option in OPTIONS:
        options += ["--plugin-option", option]
    command = ("--plugin", "minicpmo", "--model-dir", str(checkpoint), *options, *args)
    with mock.patch.object(processes, "DUPLEX", str(python.with_name("duplex"))):
        return start_serve(name, command, HF_HUB_OFFLINE="1", **env)


class HistoryWatcher:
    """Reads every MiniCPM-o session's model history under a key prefix in Redis, about ten
    times a second on a thread, while a client program runs: the records a session's
    history held at its longest (a closed session's history is deleted with it)."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.pattern = f"{prefix}:session:*:model"
        self.histories: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HistoryWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.wait(0.1):  # a poll's pace, not an ordering of events
            for key in self.client.scan_iter(match=self.pattern):
                data = self.client.get(key) or b""
                name = key.decode()
                if len(data) > len(self.histories.get(name, b"")):
                    self.histories[name] = data

    def records(self) -> dict[str, list[UnitRecord]]:
        """Each session's unit records, by its history's key."""
        return {
            key: [UnitRecord.decode(r) for r in split_records(data, MAX_RECORD_BYTES, sized=True)]
            for key, data in self.histories.items()
        }


__all__ = [
    "MODEL",
    "HistoryWatcher",
    "build_checkpoint",
    "minicpmo_python",
    "start_minicpmo_serve",
]
