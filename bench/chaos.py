"""Chaos: kill API pods or workers under live conversations; prove nothing was lost.

    .venv/bin/python -m bench.chaos [--mode api|kill|rolling|native|all] [--sessions 20]
                                    [--seconds 60] [--kill-every 3]
                                    [--native-models echo,moshi]

Two API pods, echo workers (two; three in the worker modes) and a real redis-server.
Every client is a `DuplexClient`
with automatic resume over both pods' addresses, and runs echo turns for the whole run: a
turn of unique length (so every answer names its turn: `echo <N> ms`) sent as 20 ms pcm16
appends and `input.commit`, answered at 4x real time.

mode api     every `kill-every` seconds a random API pod is SIGKILLed and restarted at the
             same address; its clients resume on the other pod. A turn whose input went
             down with the pod (no answer after the resume) is spoken again: client input in
             flight is not journaled, server events are.
mode kill    every `kill-every` seconds the worker holding the most sessions is SIGKILLed
             and restarted under the same id (a StatefulSet pod); its sessions go on on
             another worker from their checkpoints: no session closes, only the victims'
             in-flight responses fail (worker_lost), and a turn cut by the kill is spoken
             again (bench/chaos_workers.py).
mode rolling the workers are SIGTERMed and restarted one after the other, over and over
             (a rolling restart); every session moves when its worker drains: no session
             closes, no response fails, and the pause each move caused is measured.
mode native  model-native sessions (the echo frame model; the tiny Moshi where
             .venv-moshi/.installed exists) stream audio in real time while their
             workers are SIGKILLed, drained and rolled; each session's model history in
             Redis must be contiguous and equal on both sides of every move, and each
             move's replay is timed from the new worker's log (bench/chaos_native.py).

Checked for every session afterwards, from every frame the client received:
  lost        server_event_seq delivered to the application is 1..head with no gap
  duplicated  no seq delivered twice, no event_id under two seqs, one response.created
              and at most one response.done per response id
  audio       every completed response's audio equals the echo of the turn it names, or,
              for a turn a resume cut into, the echo of that turn less one run of
              appends (those in flight on the killed pod: counted as "partial", not lost)
  crashes     `Traceback` in the logs of the processes not killed on purpose
Writes docs/reliability.md (section chaos; the native runs' block chaos-native).
`run_chaos()` is also what the small chaos test in the suite runs (tests/e2e/test_chaos.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time

from bench.chaos_sessions import ANSWER_TIMEOUT_S, SESSION, WORKERS, converse
from bench.common import Stack, machine, now_utc, watchdog, write_section
from harness.recording_client import Conversation, RecordingClient, around, check, drain


@dataclasses.dataclass
class ChaosReport:
    mode: str
    sessions: int
    seconds: float
    kills: int = 0  # API pods or workers SIGKILLed; workers SIGTERMed in rolling mode
    resumes: int = 0
    events: int = 0
    turns: int = 0
    respoken: int = 0
    lost: int = 0
    duplicated: int = 0
    mismatched: int = 0
    partial: int = 0  # answers to a cut turn: exactly the input the server accepted
    tracebacks: int = 0
    closed: int = 0  # sessions that ended before the run did
    moves: int = 0  # sessions moved to another worker (drain or failover)
    failed_victims: int = 0  # responses failed with worker_lost in a killed worker's sessions
    failed_others: int = 0  # ... in any other session (must be 0)
    input_lost: int = 0  # error{input_lost} seen by clients
    recovery_s: list[float] = dataclasses.field(default_factory=list)  # kill -> next answer
    pause_ms: list[float] = dataclasses.field(default_factory=list)  # drain move pauses
    checkpoint_bytes: list[int] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    # native mode (bench/chaos_native.py): kills counts SIGKILLs there, drains and rolls
    # the SIGTERMs of one worker and of all three in turn
    model: str = ""
    drains: int = 0
    rolls: int = 0
    restores: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # frames, s
    restores_cut: int = 0  # moves whose replay never finished (its worker stopped first)
    exact_moves: int = 0  # moves whose whole old history the sampler saw the restore read
    bounded_moves: int = 0  # ... checked by the bound alone
    histories_contiguous: int = 0  # sessions whose model history passed every check
    history_problems: int = 0
    history_frames: list[int] = dataclasses.field(default_factory=list)
    coverage: list[float] = dataclasses.field(default_factory=list)  # frames x 80 ms / wall

    @property
    def ok(self) -> bool:
        return (
            not (
                self.lost
                or self.duplicated
                or self.mismatched
                or self.tracebacks
                or self.closed
                or self.failed_others
                or self.history_problems
            )
            and not self.failures
        )


async def run_chaos(
    mode: str = "api",
    sessions: int = 20,
    seconds: float = 60.0,
    kill_every: float = 3.0,
    native_model: str = "echo",
) -> ChaosReport:
    """One mode's run; `native_model` (echo or moshi) is the frame model of mode native."""
    async with watchdog(seconds + 180, f"chaos {mode}"):
        if mode == "native":
            from bench.chaos_native import MODELS, run_native

            report = ChaosReport(mode, sessions, seconds)
            await run_native(report, sessions, seconds, kill_every, MODELS[native_model])
            return report
        return await _run_chaos(mode, sessions, seconds, kill_every)


async def _run_chaos(mode: str, sessions: int, seconds: float, kill_every: float) -> ChaosReport:
    from bench.chaos_workers import WorkerChaos

    report = ChaosReport(mode, sessions, seconds)
    with Stack(workers=WORKERS[mode], apis=2) as stack:
        bases = [api.base for api in stack.apis]
        conversations = []
        for index in range(sessions):
            urls = bases[index % 2 :] + bases[: index % 2]  # half start on each pod
            client = RecordingClient(urls, heartbeat_s=1.0, ack_every=16)
            await client.connect(SESSION)
            conversations.append(Conversation(client, index))
        drains = [asyncio.create_task(drain(c.client)) for c in conversations]
        deadline = time.monotonic() + seconds
        timeout = ANSWER_TIMEOUT_S[mode]
        # rolling: every worker is rolled once, past the deadline on a slow machine, and
        # the sessions talk until it has been
        rolled = asyncio.Event() if mode == "rolling" else None
        talks = [asyncio.create_task(converse(c, deadline, timeout, rolled)) for c in conversations]
        killed: list[str] = []
        chaos = WorkerChaos(stack, conversations, report)
        if mode == "api":
            report.kills = await kill_api_pods(stack, deadline, kill_every, killed)
        elif mode == "kill":
            await chaos.kill_workers(deadline, kill_every, killed)
        else:
            assert rolled is not None
            await chaos.roll_workers(deadline, rolled)
        try:  # every turn is bounded; this bounds the whole, so a hang is a failure, not a stall
            async with asyncio.timeout(seconds + 90):
                await asyncio.gather(*talks)
        except TimeoutError:
            report.failures.append("conversations still running 90 s after the deadline")
        if mode != "api":
            await chaos.collect_moves()
        for conversation in conversations:
            await conversation.client.close(end_session=conversation.ended_by is None)
        for task in drains:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)
        report.tracebacks = sum(
            p.logs().count("Traceback")
            for p in [*stack.apis, *stack.workers, *chaos.retired]
            if p.name not in killed and p not in chaos.killed
        )
    for conversation in conversations:
        figures = check(conversation)
        report.events += figures["events"]
        report.lost += figures["lost"]
        if figures["lost"]:
            report.failures.append(
                f"session {conversation.index}: seqs {figures['missing']} lost "
                f"({around(conversation.client, figures['missing'][0])})"
            )
        report.duplicated += figures["duplicated"]
        report.mismatched += figures["mismatched"]
        report.partial += figures["partial"]
        report.resumes += conversation.client.resumes
        report.turns += conversation.turns
        report.respoken += conversation.respoken
        report.input_lost += conversation.client.input_lost
        if conversation.ended_by is not None:
            report.closed += 1
            report.failures.append(f"session {conversation.index}: {conversation.ended_by}")
    if mode != "api":
        chaos.account_failures()
    return report


async def kill_api_pods(stack: Stack, deadline: float, every: float, killed: list[str]) -> int:
    kills = 0
    while time.monotonic() + every < deadline:
        await asyncio.sleep(every * random.uniform(0.7, 1.3))
        index = random.randrange(len(stack.apis))
        victim = stack.apis[index]
        victim.kill()
        killed.append(victim.name)
        kills += 1
        name = f"api-{index}-restart-{kills}"
        stack.apis[index] = stack.start_api_at(name, victim.port)
        await asyncio.to_thread(stack.apis[index].wait_ready)
    return kills


def _spread(values: list[float], unit: str, digits: int = 0) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    median = ordered[len(ordered) // 2]
    return f"{median:.{digits}f} / {ordered[-1]:.{digits}f} {unit}".rstrip()


def render(reports: list[ChaosReport]) -> str:
    rows = [
        "| mode | sessions | seconds | kills | resumes | moves | events checked "
        "| turns answered | turns spoken again | partial answers | lost | duplicated "
        "| audio mismatches | sessions closed | failed responses (victims / others) "
        "| input_lost | kill to next answer (median / max) | move pause (median / max) "
        "| tracebacks | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        verdict = "pass" if r.ok else "FAIL: " + "; ".join(r.failures[:3])
        rows.append(
            f"| {r.mode} | {r.sessions} | {r.seconds:.0f} | {r.kills} | {r.resumes} "
            f"| {r.moves} | {r.events} | {r.turns} | {r.respoken} | {r.partial} | {r.lost} "
            f"| {r.duplicated} | {r.mismatched} | {r.closed} "
            f"| {r.failed_victims} / {r.failed_others} | {r.input_lost} "
            f"| {_spread(r.recovery_s, 's', 1)} | {_spread(r.pause_ms, 'ms')} "
            f"| {r.tracebacks} | {verdict} |"
        )
    return "\n".join(rows)


def _pace(restores: list[tuple[int, float]]) -> str:
    """Real time replayed per second of replay, median / slowest (a replay the log's
    milliseconds cannot time is at least frames x 80 ms / 0.5 ms)."""
    if not restores:
        return "-"
    paces = sorted(
        (frames * 0.08 / seconds, False) if seconds > 0 else (frames * 0.08 / 0.0005, True)
        for frames, seconds in restores
    )
    shown = [f"{'>' if floor else ''}{pace:.0f}x" for pace, floor in paces]
    return f"{shown[len(shown) // 2]} / {shown[0]}"


def render_native(reports: list[ChaosReport]) -> str:
    rows = [
        "| model | sessions | seconds | kills / drains / rolls | moves | events checked | lost "
        "| duplicated | sessions closed | responses cut (victims / others) "
        "| histories contiguous | history frames (median / max) "
        "| frames x 80 ms / wall time (median / min) | moves checked exactly / "
        "by the bound | replays cut | frames replayed per move (median / max) "
        "| replay seconds (median / max) | pace against real time (median / slowest) "
        "| move pause, drains (median / max) | tracebacks | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        verdict = "pass" if r.ok else "FAIL: " + "; ".join(r.failures[:3])
        frames = [float(f) for f, _ in r.restores]
        cover = sorted(r.coverage)
        coverage = f"{cover[len(cover) // 2]:.2f} / {cover[0]:.2f}" if cover else "-"
        seconds = [s for _, s in r.restores]
        rows.append(
            f"| {r.model} | {r.sessions} | {r.seconds:.0f} | {r.kills} / {r.drains} / {r.rolls} "
            f"| {r.moves} | {r.events} | {r.lost} | {r.duplicated} | {r.closed} "
            f"| {r.failed_victims} / {r.failed_others} "
            f"| {r.histories_contiguous} of {r.sessions} "
            f"| {_spread([float(f) for f in r.history_frames], '')} | {coverage} "
            f"| {r.exact_moves} / {r.bounded_moves} | {r.restores_cut} "
            f"| {_spread(frames, '')} | {_spread(seconds, 's', 3)} | {_pace(r.restores)} "
            f"| {_spread(r.pause_ms, 'ms')} | {r.tracebacks} | {verdict} |"
        )
    return "\n".join(rows)


MODES = ("api", "kill", "rolling", "native")


async def main(args: argparse.Namespace) -> int:
    from bench.chaos_native import moshi_available

    modes = list(MODES) if args.mode == "all" else [args.mode]
    runs = []
    for mode in modes:
        if mode != "native":
            runs.append((mode, ""))
            continue
        for model in args.native_models.split(","):
            if model == "moshi" and not moshi_available():
                print("chaos native: no .venv-moshi/.installed, the tiny Moshi is left out")
                continue
            runs.append((mode, model))
    reports = []
    for mode, model in runs:
        report = await run_chaos(mode, args.sessions, args.seconds, args.kill_every, model)
        print(report, flush=True)
        reports.append(report)
    native = [r for r in reports if r.mode == "native"]
    reports = [r for r in reports if r.mode != "native"]
    if native:
        write_native(args, native)
    if not reports:
        return 0 if all(r.ok for r in native) else 1
    sizes = sorted(b for r in reports for b in r.checkpoint_bytes)
    table = "\n".join(
        [
            f"Measured {now_utc()} on {machine()}:",
            f"`python -m bench.chaos --mode {args.mode} --sessions {args.sessions} "
            f"--seconds {args.seconds:.0f} --kill-every {args.kill_every:g}`",
            "(two API pods; two echo workers in api mode, three in kill and rolling modes;",
            "one redis-server; heartbeat TTL 5 s).",
            "",
            render(reports),
            "",
            f"Checkpoint size at the end of the run (bytes, median / max over "
            f"{len(sizes)} sessions): "
            + (f"{sizes[len(sizes) // 2]} / {sizes[-1]}." if sizes else "-"),
        ]
    )
    print(table)
    write_section("reliability.md", "chaos", table, "Chaos (`bench/chaos.py`)")
    return 0 if all(r.ok for r in [*reports, *native]) else 1


def write_native(args: argparse.Namespace, reports: list[ChaosReport]) -> None:
    """The native runs' figures: their own block of the chaos section (`chaos-native`), so
    a native run alone keeps the other modes' figures."""
    models = ",".join(r.model for r in reports)
    table = "\n".join(
        [
            f"Measured {now_utc()} on {machine()}:",
            f"`python -m bench.chaos --mode native --native-models {models} "
            f"--sessions {args.sessions} --seconds {args.seconds:.0f} "
            f"--kill-every {args.kill_every:g}`",
            "(two API pods, three workers of the frame model, one redis-server, heartbeat",
            "TTL 5 s; the echo frame model's replay is free, the tiny Moshi's is real).",
            "",
            render_native(reports),
        ]
    )
    print(table)
    write_section("reliability.md", "chaos-native", table, "Chaos, native sessions")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=[*MODES, "all"], default="all")
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=3.0)
    parser.add_argument(
        "--native-models",
        default="echo,moshi",
        help="the frame models of mode native: echo, moshi (left out without .venv-moshi)",
    )
    raise SystemExit(asyncio.run(main(parser.parse_args())))
