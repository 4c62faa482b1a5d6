"""Fuzz a running server with hostile client frames while a control session keeps talking.

    .venv/bin/python -m bench.fuzz [--frames 10000] [--connections 8] [--seed 1]

One redis-server, one echo worker, one API pod. A control session (`DuplexClient`) runs
echo turns for the whole run. `connections` fuzzing sockets send the frames of
bench/fuzz_frames.py (mutated valid events, wrong types, huge numbers, deep nesting,
invalid base64, wrong audio lengths, out-of-order protocol steps, binary garbage, and, as
the first message of a new socket, resumes with forged tokens). After each frame a
`session.heartbeat` is sent as a barrier, and what arrived before its ack is the answer:
  error     an `error` event whose code is a contract code (not internal_error)
  accepted  other events (the frame was valid)
  ignored   nothing (the contract ignores it, e.g. an event_ack)
  closed    the server closed the socket with a policy code (1000, 1008, 1009); the next
            frame opens a new session
Failures: an unknown or internal error code, close code 1011/1006, no answer within 10 s,
a `Traceback` in a server log, a dead server process, or a control turn that was not
answered with its own echo. Writes docs/reliability.md (section fuzz). Then it runs the
resource exhaustion cases of bench/exhaustion.py (`--exhaustion-scale 0` skips them).
`run_fuzz()` is what the small fuzz test in the suite runs (tests/e2e/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import random
import time

import orjson
import websockets
from websockets.exceptions import ConnectionClosed

from bench import exhaustion
from bench.chaos_sessions import SESSION, converse
from bench.common import Stack, machine, now_utc, watchdog, write_section
from bench.fuzz_frames import frames
from harness.recording_client import Conversation, RecordingClient, check, drain
from shared.protocol.duplex import ERROR_CODES

ANSWER_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 30.0
POLICY_CLOSES = {1000, 1008, 1009}


@dataclasses.dataclass
class FuzzReport:
    frames: int = 0
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    codes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: list[str] = dataclasses.field(default_factory=list)
    tracebacks: int = 0
    processes_alive: bool = True
    control_turns: int = 0
    control_problems: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            not self.failures
            and not self.tracebacks
            and self.processes_alive
            and self.control_turns > 0
            and not self.control_problems
        )


def classify_errors(events: list[dict], report: FuzzReport, frame: str | bytes) -> bool:
    """Count error codes; False (and a failure) for codes outside the contract."""
    good = True
    for event in events:
        if event.get("type") != "error":
            continue
        code = (event.get("error") or {}).get("code")
        report.codes[code] += 1
        if code not in ERROR_CODES or code == "internal_error":
            good = False
            report.failures.append(f"error code {code!r} for {str(frame)[:120]!r}")
    return good


class FuzzSocket:
    """One fuzzing connection: an open session, re-opened whenever the server closes it."""

    def __init__(self, base: str, report: FuzzReport) -> None:
        self.base = base
        self.report = report
        self.ws: websockets.ClientConnection | None = None

    async def ensure_open(self) -> websockets.ClientConnection:
        if self.ws is None:
            self.ws = await websockets.connect(f"{self.base}/v1/realtime?duplex=1", max_size=None)
            await self.ws.send(orjson.dumps({"type": "session.update", "session": {}}).decode())
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                created = orjson.loads(await self.ws.recv())
            assert created["type"] == "session.created", created
            async with asyncio.timeout(ANSWER_TIMEOUT_S):  # session.updated follows it
                updated = orjson.loads(await self.ws.recv())
            assert updated["type"] == "session.updated", updated
        return self.ws

    async def send(self, frame: str | bytes) -> None:
        ws = await self.ensure_open()
        events: list[dict] = []
        sent = False
        try:
            # the sends are bounded too: a server that stops reading a socket is a failure
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await ws.send(frame)
                await ws.send('{"type":"session.heartbeat","event_id":"barrier"}')
            sent = True
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                while True:
                    event = orjson.loads(await ws.recv())
                    events.append(event)
                    if event.get("type") == "session.heartbeat_ack":
                        break
                    if event.get("type") == "error" and (
                        (event.get("error") or {}).get("event_id") == "barrier"
                        or event.get("related_event_id") == "barrier"
                    ):
                        break  # the barrier itself was refused: the session is gone
        except ConnectionClosed as exc:
            self.ws = None
            code = exc.rcvd.code if exc.rcvd else 1006
            classify_errors(events, self.report, frame)
            self.report.outcomes[f"closed {code}"] += 1
            if code not in POLICY_CLOSES:
                self.report.failures.append(f"close {code} after {str(frame)[:120]!r}")
            return
        except TimeoutError:
            what = f"no answer within {ANSWER_TIMEOUT_S}s" if sent else "the send blocked"
            self.report.failures.append(f"{what}: {frame!r:.120}")
            await ws.close()
            self.ws = None
            return
        answer = events[:-1]
        if not classify_errors(answer, self.report, frame):
            self.report.outcomes["bad error"] += 1
        elif any(e.get("type") == "error" for e in answer):
            self.report.outcomes["error"] += 1
        elif answer:
            self.report.outcomes["accepted"] += 1
        else:
            self.report.outcomes["ignored"] += 1

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()


async def first_message(base: str, frame: str | bytes, report: FuzzReport) -> None:
    """A new socket in resume-only mode whose first message is hostile: it must be refused
    with a contract error (or closed), never hang, and never touch the live session."""
    events: list[dict] = []
    try:
        async with (
            asyncio.timeout(SEND_TIMEOUT_S + ANSWER_TIMEOUT_S),
            websockets.connect(f"{base}/v1/realtime?duplex=1&autostart=0") as ws,
        ):
            await ws.send(frame)
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                events.append(orjson.loads(await ws.recv()))
    except ConnectionClosed as exc:
        code = exc.rcvd.code if exc.rcvd else 1006
        if code not in POLICY_CLOSES:
            report.failures.append(f"first message: close {code} after {str(frame)[:120]!r}")
    except TimeoutError:
        report.failures.append(f"first message: no answer within {ANSWER_TIMEOUT_S}s")
    if classify_errors(events, report, frame):
        report.outcomes["first message refused" if events else "first message closed"] += 1


async def one_more_turn(conversation: Conversation, talking: asyncio.Task[None]) -> None:
    """Wait until the control session answers one more turn after the last hostile frame
    (or its conversation ended, which the report counts): seen, not slept for."""
    client, before = conversation.client, conversation.turns
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(2 * ANSWER_TIMEOUT_S):
            while conversation.turns == before and not talking.done():
                client.progress.clear()
                await client.progress.wait()
    if conversation.turns == before and conversation.ended_by is None:
        conversation.ended_by = "no control turn answered after the last hostile frame"


async def run_fuzz(frame_count: int = 10_000, connections: int = 8, seed: int = 1) -> FuzzReport:
    async with watchdog(120 + frame_count / 20, "fuzz"):
        return await _run_fuzz(frame_count, connections, seed)


async def _run_fuzz(frame_count: int, connections: int, seed: int) -> FuzzReport:
    report = FuzzReport()
    started = time.monotonic()
    with Stack() as stack:
        base = stack.ws_bases()[0]
        control = RecordingClient([stack.apis[0].base], heartbeat_s=1.0)
        await control.connect(SESSION)
        conversation = Conversation(control, 0)
        drainer = asyncio.create_task(drain(control))
        talking = asyncio.create_task(converse(conversation, float("inf"), 15.0))
        rng = random.Random(seed)
        plan = frames(rng, frame_count, control.session_id or "")

        async def fuzz(share: list[tuple[str, str | bytes]]) -> None:
            sock = FuzzSocket(base, report)
            for where, frame in share:
                report.frames += 1
                if where == "first":
                    await first_message(base, frame, report)
                else:
                    await sock.send(frame)
            await sock.close()

        await asyncio.gather(*(fuzz(plan[i::connections]) for i in range(connections)))
        await one_more_turn(conversation, talking)  # the control session still talks
        talking.cancel()
        await asyncio.gather(talking, return_exceptions=True)
        ended = conversation.ended_by
        await control.close()
        drainer.cancel()
        await asyncio.gather(drainer, return_exceptions=True)
        figures = check(conversation)
        report.control_turns = conversation.turns
        report.control_problems = figures["lost"] + figures["duplicated"] + figures["mismatched"]
        if ended is not None:
            report.control_problems += 1
            report.failures.append(f"control session ended: {ended}")
        processes = [*stack.apis, *stack.workers]
        report.processes_alive = all(p.process.poll() is None for p in processes)
        report.tracebacks = sum(p.logs().count("Traceback") for p in processes)
    report.seconds = time.monotonic() - started
    return report


def render(report: FuzzReport, args: argparse.Namespace) -> str:
    outcomes = ", ".join(f"{name} {n}" for name, n in report.outcomes.most_common())
    codes = ", ".join(f"`{code}` {n}" for code, n in report.codes.most_common())
    verdict = "pass" if report.ok else "FAIL: " + "; ".join(report.failures[:5])
    return "\n".join(
        [
            f"Measured {now_utc()} on {machine()}:",
            f"`python -m bench.fuzz --frames {args.frames} --connections {args.connections} "
            f"--seed {args.seed}` ({report.seconds:.0f} s).",
            "",
            "| frames | failures | server tracebacks | processes alive | control turns answered "
            "| control lost / duplicated / wrong audio | verdict |",
            "|---|---|---|---|---|---|---|",
            f"| {report.frames} | {len(report.failures)} | {report.tracebacks} "
            f"| {'yes' if report.processes_alive else 'NO'} | {report.control_turns} "
            f"| {report.control_problems} | {verdict} |",
            "",
            f"Outcomes: {outcomes}.",
            "",
            f"Error codes answered: {codes}.",
        ]
    )


async def main(args: argparse.Namespace) -> int:
    report = await run_fuzz(args.frames, args.connections, args.seed)
    table = render(report, args)
    print(table)
    for failure in report.failures[:30]:
        print("FAILURE:", failure)
    write_section("reliability.md", "fuzz", table, "Fuzzing (`bench/fuzz.py`)")
    exhausted = True
    if args.exhaustion_scale > 0:  # then the resource exhaustion cases (bench/exhaustion.py)
        exhausted = await exhaustion.main(argparse.Namespace(scale=args.exhaustion_scale)) == 0
    return 0 if report.ok and exhausted else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=10_000)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--exhaustion-scale",
        type=float,
        default=1.0,
        help="then run bench/exhaustion.py at this scale (0: skip)",
    )
    raise SystemExit(asyncio.run(main(parser.parse_args())))
