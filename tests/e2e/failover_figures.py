"""The figures of a Redis failover test, as data: what each test prints, and, when
`DUPLEX_FAILOVER_FIGURES` names a directory, a JSON file of them per run there, which
`bench/redis_failover.py` sums up over repeated runs into docs/benchmarks.md. The same
runs assert the product's promises; the figures are never asserted."""

from __future__ import annotations

import itertools
import os
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

from harness.processes import Process
from harness.recording_client import check

ENV = "DUPLEX_FAILOVER_FIGURES"


def count_lines(log: str, *needles: str) -> int:
    return sum(1 for line in log.splitlines() if any(needle in line for needle in needles))


def strictly_increasing(seqs: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(seqs))


def seconds_after(moment: float | None, killed: float) -> float | None:
    return None if moment is None else round(moment - killed, 2)


def session_figures(label: str, talker: Any, killed: float, **extra: Any) -> dict[str, Any]:
    """One session's figures (`talker`: tests/e2e/test_redis_failover.py's `Talker`): when
    it talked again after the kill (a turn spoken after it answered), its turns, refusals,
    resumes, how it ended, and what its client saw of the journal (events lost or twice,
    seqs strictly increasing)."""
    client = talker.client
    seen = check(talker.conversation)
    return {
        "label": label,
        "talks_again_s": seconds_after(talker.talked_since(killed), killed),
        "turns": talker.conversation.turns,
        "refused": talker.refused,
        "unanswered": talker.unanswered,
        "resumes": client.resumes,
        "closed": talker.conversation.ended_by or client.ended,
        "lost": seen["lost"],
        "duplicated": seen["duplicated"],
        "seqs_increasing": strictly_increasing(client.wire_seqs),
        **extra,
    }


def log_figures(processes: list[Process]) -> dict[str, dict[str, int]]:
    """WARNING, ERROR and Traceback lines of each process's log."""
    return {
        process.name: {
            "WARNING": count_lines(process.logs(), " WARNING "),
            "ERROR": count_lines(process.logs(), " ERROR "),
            "Traceback": count_lines(process.logs(), "Traceback"),
        }
        for process in processes
    }


def record(scenario: str, figures: dict[str, Any]) -> None:
    """Write the run's figures where the bench asked for them (nothing when it did not)."""
    where = os.environ.get(ENV)
    if not where:
        return
    name = f"{scenario}-{time.time_ns()}-{uuid.uuid4().hex[:6]}.json"
    Path(where, name).write_bytes(orjson.dumps({"scenario": scenario, **figures}))
