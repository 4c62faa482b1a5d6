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
import base64
import dataclasses
import random
import re
import time
from typing import Any

import numpy as np

from bench.common import Stack, machine, now_utc, watchdog, write_section
from plugins.echo.stage import resample_whole
from shared.client.duplex_client import DuplexClient, DuplexClientError
from shared.protocol.duplex import float_to_pcm16, pcm16_to_float

SESSION = {
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
    "extra_body": {"pace": 4},
}
# api mode: a resume takes well under a second, an answer at 4x real time half a second.
# worker modes: a lost worker is noticed after its heartbeat TTL (5 s) + a janitor tick,
# or when it restarts; a drain waits for the response in flight.
ANSWER_TIMEOUT_S = {"api": 5.0, "kill": 15.0, "rolling": 15.0}
WORKERS = {"api": 2, "kill": 3, "rolling": 3}
SEND_TIMEOUT_S = 30.0
ECHO_MS = re.compile(r"echo (\d+) ms")


def turn_audio(duration_ms: int) -> bytes:
    """A tone whose pitch and length are the turn's own, swelling so that no two of its
    20 ms appends are alike (a missing append shows where it was missing)."""
    t = np.arange(16 * duration_ms) / 16000
    hz = 200 + duration_ms % 997
    swell = 0.15 + 0.15 * t / t[-1]
    return float_to_pcm16((swell * np.sin(2 * np.pi * hz * t)).astype(np.float32))


def expected_echo(pcm: bytes) -> bytes:
    return float_to_pcm16(resample_whole(pcm16_to_float(pcm), 16000, 24000))


class RecordingClient(DuplexClient):
    """A DuplexClient that keeps every frame it received and assembles every response."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.frames: list[dict[str, Any]] = []  # as received, duplicates included
        self.delivered: list[dict[str, Any]] = []  # as handed to the application
        self.audio: dict[str, list[bytes]] = {}
        self.transcripts: dict[str, str] = {}
        self.done: list[tuple[str, str, int | None]] = []  # (response id, status, echo ms)
        self.answered: set[int] = set()
        self.received_at: list[float] = []  # monotonic time each delivered frame arrived
        self.completed_at: list[float] = []  # ... of each completed response.done
        self.worker_lost: list[str] = []  # responses that failed with worker_lost
        self.input_lost = 0  # error{input_lost}: commands lost while the session moved
        self.progress = asyncio.Event()
        self.ended: str | None = None  # the code that ended the session, or a client failure

    def _deliver(self, data: dict[str, Any]) -> None:
        self.frames.append(data)
        before = self.last_seq
        super()._deliver(data)
        seq = data.get("server_event_seq")
        if seq is not None and seq <= before:
            return  # dropped by the client as already delivered
        self.delivered.append(data)
        self.received_at.append(time.monotonic())
        kind, response_id = data.get("type"), data.get("response_id")
        if kind == "response.output_audio.delta":
            self.audio.setdefault(response_id, []).append(base64.b64decode(data["delta"]))
        elif kind == "response.output_audio_transcript.done":
            self.transcripts[response_id] = data.get("transcript", "")
        elif kind == "response.done":
            response = data.get("response") or {}
            rid = response.get("id", "")
            match = ECHO_MS.fullmatch(self.transcripts.get(rid, ""))
            ms = int(match.group(1)) if match else None
            self.done.append((rid, response.get("status", ""), ms))
            if response.get("status") == "completed":
                self.completed_at.append(time.monotonic())
                if ms is not None:
                    self.answered.add(ms)
            error = ((response.get("status_details") or {}).get("error") or {}).get("code")
            if response.get("status") == "failed" and error == "worker_lost":
                self.worker_lost.append(rid)
        elif kind == "error" and (data.get("error") or {}).get("code") == "input_lost":
            self.input_lost += 1
        elif kind == "session.closed" and self.ended is None:
            self.ended = closed_reason(self)
        self.progress.set()


@dataclasses.dataclass
class Conversation:
    client: RecordingClient
    index: int
    spoken: dict[int, bytes] = dataclasses.field(default_factory=dict)  # echo ms -> input
    # turns a resume or a worker's loss cut into
    resumed_in: set[int] = dataclasses.field(default_factory=set)
    turns: int = 0
    respoken: int = 0
    ended_by: str | None = None  # "worker_lost", or an unexpected failure
    # a native session's audio is the model's own: only its events are checked
    audio_checked: bool = True


async def speak(client: RecordingClient, pcm: bytes) -> None:
    await client.send({"type": "input_audio_buffer.clear"})
    for i in range(0, len(pcm), 640):
        await client.append_audio(pcm[i : i + 640])
    await client.send({"type": "input.commit"})


async def converse(
    conversation: Conversation,
    deadline: float,
    answer_timeout: float,
    until: asyncio.Event | None = None,
) -> None:
    """Turns until the deadline, and past it until `until` is set (the chaos finished
    what it must do under talking sessions, however slow the machine)."""
    client = conversation.client
    next_ms = 200 + 20 * (conversation.index % 7)
    try:
        while time.monotonic() < deadline or (until is not None and not until.is_set()):
            duration = next_ms
            next_ms += 20
            pcm = turn_audio(duration)
            conversation.spoken[duration] = pcm
            resumes, disruptions = client.resumes, disruptions_of(client)
            # a send waits while the client resumes; one that never returns is a failure
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await speak(client, pcm)
            answered = await wait_answer(client, duration, answer_timeout, disruptions)
            cut = client.resumes > resumes or disruptions_of(client) > disruptions
            if cut:
                conversation.resumed_in.add(duration)
            if answered:
                conversation.turns += 1
            elif cut:
                conversation.respoken += 1  # its input went down with a killed pod or worker
            else:
                conversation.ended_by = f"turn of {duration} ms never answered"
                return
    except DuplexClientError as exc:
        conversation.ended_by = exc.code
    except TimeoutError:
        conversation.ended_by = client.ended or "a send never completed"
    except ConnectionError as exc:
        conversation.ended_by = f"connection: {exc}"


def disruptions_of(client: RecordingClient) -> int:
    """What tells a client its turn was cut by a lost worker: its response failed with
    worker_lost, or its input was lost while the session moved."""
    return len(client.worker_lost) + client.input_lost


async def wait_answer(
    client: RecordingClient, duration: int, timeout: float, disruptions: int = 0
) -> bool:
    """True once the turn is answered; False at the timeout, or as soon as a lost worker
    cut the turn (it is spoken again)."""
    deadline = time.monotonic() + timeout
    while duration not in client.answered:
        if client.ended is not None:
            raise DuplexClientError(client.ended, "session ended")
        if disruptions_of(client) > disruptions:
            return False
        client.progress.clear()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            async with asyncio.timeout(remaining):
                await client.progress.wait()
        except TimeoutError:
            return False
    return True


def closed_reason(client: RecordingClient) -> str:
    codes = [
        (f.get("error") or {}).get("code") for f in client.delivered if f.get("type") == "error"
    ]
    return codes[-1] if codes else "session_closed"


async def drain(client: RecordingClient) -> None:
    """Keep the client's event queue empty (the checks read the recorded frames); a resume
    the server refused ends the session for the conversation."""
    try:
        while True:
            await client.recv(timeout=None)
    except DuplexClientError as exc:
        client.ended = client.ended or f"resume refused: {exc.code}"
        client.progress.set()


def check(conversation: Conversation) -> dict[str, Any]:
    """Lost and duplicated events and audio mismatches of one session."""
    client = conversation.client
    seqs = [f["server_event_seq"] for f in client.delivered if "server_event_seq" in f]
    head = max(seqs, default=0)
    cancelled = {rid for rid, status, _ in client.done if status == "cancelled"}
    missing = [
        seq
        for seq in sorted(set(range(1, head + 1)) - set(seqs))
        if not cancelled_audio(client, seq, cancelled)
    ]
    lost = len(missing)
    duplicated = len(seqs) - len(set(seqs))
    by_id: dict[str, set[int]] = {}
    for frame in client.frames:
        if "server_event_seq" in frame and frame.get("event_id"):
            by_id.setdefault(frame["event_id"], set()).add(frame["server_event_seq"])
    duplicated += sum(len(s) - 1 for s in by_id.values())
    created = [f["response"]["id"] for f in client.delivered if f["type"] == "response.created"]
    duplicated += len(created) - len(set(created))
    done_ids = [rid for rid, _, _ in client.done]
    duplicated += len(done_ids) - len(set(done_ids))
    mismatched = partial = 0
    for rid, status, ms in client.done:
        if status != "completed" or not conversation.audio_checked:
            continue
        audio = b"".join(client.audio.get(rid, []))
        pcm = conversation.spoken.get(ms) if ms is not None else None
        if pcm is not None and audio == expected_echo(pcm):
            continue
        if ms is not None and answers_a_cut_turn(conversation, ms, audio):
            partial += 1
        else:
            mismatched += 1
    return {
        "lost": lost,
        "missing": missing[:5],
        "duplicated": duplicated,
        "mismatched": mismatched,
        "partial": partial,
        "events": head,
    }


def cancelled_audio(client: RecordingClient, seq: int, cancelled: set[str]) -> bool:
    """Whether a seq the client never got was audio of a response that ended cancelled:
    an API pod drops the still-queued audio deltas of a cancelled response (the seed's
    output policy: a barge-in must not keep playing), so their seqs never reach the client.
    Known by its neighbours: the events just before and after it belong to that response."""
    before = max(
        (f for f in client.delivered if (f.get("server_event_seq") or 0) < seq),
        key=lambda f: f["server_event_seq"],
        default=None,
    )
    after = min(
        (f for f in client.delivered if (f.get("server_event_seq") or 0) > seq),
        key=lambda f: f["server_event_seq"],
        default=None,
    )
    return any(f is not None and f.get("response_id") in cancelled for f in (before, after))


def around(client: RecordingClient, seq: int) -> str:
    """What the client got around a lost seq (a clue for whoever reads the failure)."""
    got = [f.get("type") for f in client.frames if f.get("server_event_seq") == seq]
    before = [
        f"{f.get('server_event_seq')}:{f.get('type')}"
        for f in client.delivered
        if seq - 3 <= (f.get("server_event_seq") or 0) <= seq + 3
    ]
    statuses = {rid: status for rid, status, _ in client.done}
    near = {
        f.get("response_id"): statuses.get(f.get("response_id"))
        for f in client.delivered
        if seq - 3 <= (f.get("server_event_seq") or 0) <= seq + 3 and f.get("response_id")
    }
    return f"received as {got or 'nothing'}; delivered around it: {before}; responses {near}"


def answers_a_cut_turn(conversation: Conversation, ms: int, audio: bytes) -> bool:
    """Whether `audio` (an answer naming `ms`) is the echo of a turn a resume cut into,
    less one contiguous run of its 20 ms appends: the ones written to the socket of the
    pod that was killed. Client input in flight is not journaled (docs/reliability.md);
    what the server did accept must still come back exactly."""
    for duration in conversation.resumed_in:
        missing, rest = divmod(duration - ms, 20)
        if missing <= 0 or rest:
            continue
        chunks = [conversation.spoken[duration][i : i + 640] for i in range(0, 32 * duration, 640)]
        for start in range(len(chunks) - missing + 1):
            kept = b"".join(chunks[:start] + chunks[start + missing :])
            if audio == expected_echo(kept):
                return True
    return False


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
