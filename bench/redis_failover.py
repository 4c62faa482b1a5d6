"""Redis failing over under talking sessions: the figures of repeated failovers, summed up.

Each scenario is one of the suite's failover tests on real processes (`duplex api`,
`duplex worker`, redis-server, redis-server --sentinel), which assert what the product
promises (no session closed, no event lost, repeated or going back, every session talking
again) and record what they measured. This program runs each `--runs` times, in a pytest
of its own (so the figures published are those of runs that also passed every assertion,
and a run that failed is counted as such), collects their figures
(`DUPLEX_FAILOVER_FIGURES`, tests/e2e/failover_figures.py) and writes the ranges to
docs/benchmarks.md:

- `sentinel`: a primary, its replica and three sentinels; 2 API pods, 1 echo worker, 4
  duplex-surface sessions taking turns; the primary SIGKILLed;
- `kinds`: the same set; 2 API pods, 2 echo workers and a native frame-model worker; a
  cascade and a native session talking, a resume and a drain in flight at the kill;
- `cluster`: 3 masters with a replica each (node timeout 2 s); 2 API pods, 2 workers, 6
  sessions; the master holding most sessions' keys SIGKILLed;
- `cluster-left`: 3 masters, no replica; the master of the only worker's own keys
  SIGKILLed and left dead;
- `lost-writes`: the Sentinel set with the replica cut off first, so the promoted replica
  lacks the last 1.5 s of writes.

    .venv/bin/python -m bench.redis_failover [--runs 3] [--scenarios sentinel,kinds,...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.common import ROOT, add_output_arguments, commit, machine, now_utc, write_section

#: where the tests write their figures (tests/e2e/failover_figures.py reads the same name)
FIGURES_ENV = "DUPLEX_FAILOVER_FIGURES"
E2E = "tests/e2e"
SCENARIOS: dict[str, tuple[str, str]] = {
    "sentinel": (
        f"{E2E}/test_redis_failover.py::test_sentinel_primary_killed_while_sessions_talk",
        "Sentinel, primary killed: 2 API pods, 1 worker, 4 cascade sessions",
    ),
    "kinds": (
        f"{E2E}/test_redis_failover_kinds.py",
        "Sentinel, primary killed: a cascade and a native session talking, a resume and a "
        "drain in flight",
    ),
    "cluster": (
        f"{E2E}/test_redis_cluster_failover.py::test_cluster_master_killed_while_sessions_talk",
        "Cluster (3 masters + 3 replicas), the master of most sessions' keys killed: 2 API "
        "pods, 2 workers, 6 sessions",
    ),
    "cluster-left": (
        f"{E2E}/test_redis_cluster_failover.py"
        "::test_a_master_holding_a_workers_own_keys_pauses_only_the_sessions_it_holds",
        "Cluster (3 masters, no replica), the master of the worker's own keys killed and left "
        "dead: 1 API pod, 1 worker, 6 sessions",
    ),
    "lost-writes": (
        f"{E2E}/test_redis_lost_writes.py",
        "Sentinel, the replica cut off 1.5 s before the primary is killed (writes lost on "
        "purpose): 2 API pods, 1 worker, 4 sessions",
    ),
}
#: one scenario run's limit (a run takes 20-40 s on a 2-core machine)
RUN_TIMEOUT_S = 600


def run_scenario(name: str, runs: int) -> tuple[int, list[dict[str, Any]]]:
    """Run the scenario's test `runs` times; how many passed, and every run's figures."""
    node = SCENARIOS[name][0]
    passed = 0
    figures: list[dict[str, Any]] = []
    for index in range(runs):
        with tempfile.TemporaryDirectory(prefix="duplex-failover-") as where:
            env = {**os.environ, FIGURES_ENV: where}
            command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:randomly", node]
            started = time.monotonic()
            done = subprocess.run(
                command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
            )
            ok = done.returncode == 0
            passed += ok
            for path in sorted(Path(where).glob("*.json")):
                figures.append({**json.loads(path.read_text()), "passed": ok})
            took = time.monotonic() - started
            print(f"[{name} run {index + 1}/{runs}: {'passed' if ok else 'FAILED'}, {took:.0f} s]")
            if not ok:
                print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", file=sys.stderr)
    return passed, figures


def span(values: Iterable[float | None], unit: str = " s") -> str:
    """min-max of the values present; "never" when some never came."""
    values = list(values)
    present = sorted(v for v in values if v is not None)
    if not present:
        return "never" if values else "-"
    low, high = present[0], present[-1]
    text = f"{low:.2f}{unit}" if low == high else f"{low:.2f}-{high:.2f}{unit}"
    missing = len(values) - len(present)
    return text + (f" ({missing} never)" if missing else "")


def int_span(values: Iterable[int]) -> str:
    values = sorted(values)
    if not values:
        return "-"
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def sessions_of(runs: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [
        s
        for run in runs
        for s in run.get("sessions", [])
        if all(s.get(k) == v for k, v in match.items())
    ]


def talk_again(name: str, runs: list[dict[str, Any]]) -> str:
    """Kill -> a turn spoken after it answered, by the groups the scenario has."""
    if name == "kinds":
        labels = dict.fromkeys(s["label"] for s in sessions_of(runs))
        return "; ".join(
            f"{label} {span(s['talks_again_s'] for s in sessions_of(runs, label=label))}"
            for label in labels
        )
    if name in ("cluster", "cluster-left"):
        elsewhere = sessions_of(runs, keys_on_lost_master=False)
        theirs = [s for s in elsewhere if s.get("worker_keys_on_lost_master")]
        lost = sessions_of(runs, keys_on_lost_master=True)
        parts = [f"keys on surviving masters {span(s['talks_again_s'] for s in elsewhere)}"]
        if theirs and name == "cluster":
            parts.append(
                "of them, a worker whose own keys were on the lost master "
                + span(s["talks_again_s"] for s in theirs)
            )
        parts.append(
            f"keys on the lost master {span(s['talks_again_s'] for s in lost)}"
            + (" (it stays dead)" if name == "cluster-left" else "")
        )
        return "; ".join(parts)
    return span(s["talks_again_s"] for s in sessions_of(runs))


def outcomes(runs: list[dict[str, Any]]) -> str:
    sessions = sessions_of(runs)
    closed = sum(1 for s in sessions if s["closed"])
    lost = sum(s["lost"] for s in sessions)
    twice = sum(s["duplicated"] for s in sessions)
    back = sum(1 for s in sessions if not s["seqs_increasing"])
    return f"{closed} / {lost} / {twice} / {back}"


def logs(runs: list[dict[str, Any]], level: str) -> str:
    return int_span(sum(p[level] for p in run.get("logs", {}).values()) for run in runs)


def notes(name: str, runs: list[dict[str, Any]]) -> str:
    if name == "kinds":
        resumes = [run["resume"] for run in runs if "resume" in run]
        drains = [run["drain"] for run in runs if "drain" in run]
        native = sessions_of(runs, label="native")
        return (
            f"resume: {', '.join(sorted({r['outcome'] for r in resumes}))}"
            f" {span(r['after_s'] for r in resumes)} after the kill,"
            f" {int_span(r['tries'] for r in resumes)} tries; drain: moved"
            f" {sum(d['moved'] for d in drains)}/{len(drains)}, its long turn answered"
            f" {span(d['long_turn_answered_s'] for d in drains)}, exit codes"
            f" {sorted({d['exit_code'] for d in drains})}; native first answer"
            f" {span(s.get('first_answer_s') for s in native)}"
        )
    if name == "lost-writes":
        sessions = sessions_of(runs)
        return (
            f"journaled events lost a session {int_span(s['journal_lost'] for s in sessions)},"
            f" seq_regressions {int_span(s['seq_regressions'] for s in sessions)},"
            f" resyncs {sum(s['resyncs'] for s in sessions)}"
        )
    return ""


def render(results: dict[str, tuple[int, list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    rows = [
        "| scenario | runs passed | kill -> promoted | kill -> a session talks again |"
        " closed / lost / twice / back | refused turns a session | WARNING lines a run"
        " (all processes) | ERROR / Traceback lines | more |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (passed, runs) in results.items():
        sessions = sessions_of(runs)
        promoted = [run.get("promoted_s") for run in runs if "promoted_s" in run]
        rows.append(
            f"| {SCENARIOS[name][1]} | {passed}/{args.runs}"
            f" | {span(promoted) if promoted else 'no replica'}"
            f" | {talk_again(name, runs)} | {outcomes(runs)}"
            f" | {int_span(s['refused'] for s in sessions)} | {logs(runs, 'WARNING')}"
            f" | {logs(runs, 'ERROR')} / {logs(runs, 'Traceback')} | {notes(name, runs)} |"
        )
    command = f"python -m bench.redis_failover --runs {args.runs} --scenarios {args.scenarios}"
    return "\n".join(
        [
            f"Measured {now_utc()} on {machine()}, code at commit {commit()}: `{command}`.",
            "",
            "Each run is one of the suite's failover tests on real processes (the scenario"
            " and its assertions: docs/reliability.md, When Redis fails over); *closed / lost"
            " / twice / back* count, over all runs, the sessions closed, the events a client"
            " never received, the events it received twice, and the clients whose seqs ever"
            " went back; *talks again* is the kill to the answer of the first turn spoken"
            " after it (a turn in flight at the kill answers first).",
            "",
            *rows,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    add_output_arguments(parser, "redis_failover")
    args = parser.parse_args()
    names = [name for name in args.scenarios.split(",") if name]
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}: choose from {', '.join(SCENARIOS)}")
    results = {name: run_scenario(name, args.runs) for name in names}
    table = render(results, args)
    print(table)
    heading = "Redis failing over under talking sessions (`bench/redis_failover.py`)"
    if args.label:
        heading += f", {args.label}"
    write_section("benchmarks.md", args.section, table, heading, args.docs)


if __name__ == "__main__":
    main()
