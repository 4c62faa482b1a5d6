"""What the framework clients share: their arguments, the speech files, a microphone that
streams in real time, the warnings they capture, the GA check of raw server events, and the
one JSON line each prints.

Runs in a framework's venv (never the project's): the standard library, plus the `openai`
package every framework there depends on, for the GA check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
import traceback
import wave
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

#: the scenarios every client runs; `defaults` keeps the framework's own turn detection,
#: `manual` turns it off and drives turns with the framework's commit/reply/interrupt API
SCENARIOS = ("defaults_turns", "manual_turns", "defaults_tool", "manual_tool")

#: the tool the tool scenarios declare, and what it returns
TOOL_NAME = "get_weather"
TOOL_DESCRIPTION = "Get the current weather."
TOOL_OUTPUT = "It is sunny and 21 degrees"

#: the rate of the audio every framework sends and receives (OpenAI's pcm16 default)
RATE = 24000


def parse_args(framework: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=f"{framework} against duplex serve")
    parser.add_argument("--url", required=True, help="http://HOST:PORT of duplex serve")
    parser.add_argument("--model", default="assistant")
    parser.add_argument("--scenario", required=True, choices=SCENARIOS)
    parser.add_argument(
        "--speech",
        action="append",
        default=[],
        metavar="NAME=WAV",
        help="a phrase the scenario says, as a mono pcm16 WAV (repeatable)",
    )
    parser.add_argument("--step-timeout", type=float, default=30.0)
    return parser.parse_args()


def read_wav(path: str) -> tuple[bytes, int]:
    """A mono 16-bit WAV's frames and rate."""
    with wave.open(path, "rb") as wav:
        if wav.getnchannels() != 1 or wav.getsampwidth() != 2:
            raise ValueError(f"{path}: not mono pcm16")
        return wav.readframes(wav.getnframes()), wav.getframerate()


def resample_pcm16(pcm: bytes, rate: int, to: int = RATE) -> bytes:
    """Linear interpolation, good enough for speech the server's ASR reads at 16 kHz."""
    if rate == to:
        return pcm
    import array

    source = array.array("h")
    source.frombytes(pcm)
    count = len(source) * to // rate
    out = array.array("h", bytes(2 * count))
    for i in range(count):
        position = i * rate / to
        j = int(position)
        frac = position - j
        a = source[j]
        b = source[j + 1] if j + 1 < len(source) else a
        out[i] = int(a + (b - a) * frac)
    return out.tobytes()


def speech(args: argparse.Namespace, rate: int = RATE) -> dict[str, bytes]:
    """The phrases passed with --speech, as pcm16 at `rate`."""
    phrases = {}
    for spec in args.speech:
        name, _, path = spec.partition("=")
        pcm, wav_rate = read_wav(path)
        phrases[name] = resample_pcm16(pcm, wav_rate, rate)
    return phrases


def silence(seconds: float, rate: int = RATE) -> bytes:
    return bytes(2 * int(seconds * rate))


class Microphone:
    """Streams pcm16 in 20 ms chunks in real time, like a microphone; with `idle_silence`
    it keeps streaming silence between phrases, as a live microphone does."""

    def __init__(
        self,
        push: Callable[[bytes], Awaitable[None] | None],
        rate: int = RATE,
        idle_silence: bool = False,
    ) -> None:
        self.push = push
        self.rate = rate
        self.chunk = 2 * rate // 50
        self.idle_silence = idle_silence
        self.queue: asyncio.Queue[tuple[bytes, asyncio.Future[None]]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> Microphone:
        self.task = asyncio.create_task(self._run())
        return self

    async def say(self, pcm: bytes) -> None:
        """Stream `pcm`; returns once its last chunk was pushed."""
        done = asyncio.get_running_loop().create_future()
        await self.queue.put((pcm, done))
        await done

    def saying(self, pcm: bytes) -> asyncio.Task[None]:
        return asyncio.create_task(self.say(pcm))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            try:
                pcm, done = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                if not self.idle_silence:
                    pcm, done = await self.queue.get()
                    due = loop.time()
                else:
                    pcm, done = silence(0.02, self.rate), None
            for start in range(0, len(pcm), self.chunk):
                await asyncio.sleep(max(0.0, due - loop.time()))
                result = self.push(pcm[start : start + self.chunk])
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    await result
                due += len(pcm[start : start + self.chunk]) / 2 / self.rate
            if done is not None and not done.done():
                done.set_result(None)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


class WarningCapture(logging.Handler):
    """Every log record at WARNING or above, from any logger (the frameworks log there)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[dict[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message += f" [{type(record.exc_info[1]).__name__}: {record.exc_info[1]}]"
        self.add(record.name, record.levelname, message)

    def add(self, logger: str, level: str, message: str) -> None:
        self.records.append({"logger": logger, "level": level, "message": message[:2000]})

    def install(self) -> WarningCapture:
        logging.captureWarnings(True)
        root = logging.getLogger()
        root.addHandler(self)
        if root.level > logging.WARNING or root.level == logging.NOTSET:
            root.setLevel(logging.WARNING)
        return self


_GA_ADAPTER: Any = None


def ga_problem(event: dict[str, Any]) -> str | None:
    """Why `event` is not an OpenAI GA Realtime server event (openai's own models), or None."""
    global _GA_ADAPTER
    if _GA_ADAPTER is None:
        from typing import Annotated

        from openai.types.realtime import RealtimeServerEvent
        from pydantic import Field, TypeAdapter

        _GA_ADAPTER = TypeAdapter(Annotated[RealtimeServerEvent, Field(discriminator="type")])
    try:
        _GA_ADAPTER.validate_python(event)
    except Exception as error:  # pydantic.ValidationError, or anything the union raises
        lines = [
            line.strip()
            for line in str(error).splitlines()[1:]
            if "errors.pydantic.dev" not in line
        ]
        return f"{event.get('type')}: {'; '.join(lines)[:400]}"
    return None


@dataclass
class Response:
    """One response as the client saw it: the server's record and the framework's streams."""

    id: str
    status: str | None = None
    reason: str | None = None
    audio_samples: int = 0
    transcript: str = ""
    function_calls: list[dict[str, str]] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status,
            "reason": self.reason,
            "audio_samples": self.audio_samples,
            "transcript": self.transcript,
            "function_calls": self.function_calls,
        }


class Report:
    """What a client prints: the scenario's steps and everything it saw on the way."""

    def __init__(self, framework: str, args: argparse.Namespace) -> None:
        self.framework = framework
        self.args = args
        self.scenario = args.scenario
        self.model = args.model
        self.step_timeout = args.step_timeout
        self.warnings = WarningCapture().install()
        self.server_events: Counter[str] = Counter()
        #: the first problem of each server event type that is not GA (see ga_problem)
        self.ga_problems: dict[str, str] = {}
        self.client_events: Counter[str] = Counter()
        #: the server events in order (deltas left out), to tell what happened when a step fails
        self.trace: list[str] = []
        self.errors: list[str] = []
        self.user_transcripts: list[str] = []
        self.steps: dict[str, Any] = {}
        self.failed_step: str | None = None
        self.exception: str | None = None
        self.started = time.monotonic()
        self._changed = asyncio.Condition()

    def server_event(self, event: dict[str, Any]) -> None:
        kind = str(event.get("type"))
        self.server_events[kind] += 1
        if not kind.endswith(".delta") and len(self.trace) < 400:
            status = (event.get("response") or {}).get("status")
            self.trace.append(f"{kind}:{status}" if kind == "response.done" else kind)
        if kind not in self.ga_problems and (problem := ga_problem(event)):
            self.ga_problems[kind] = problem
        if kind == "error":
            self.errors.append(json.dumps(event.get("error"))[:500])
        self.notify()

    def client_event(self, kind: str) -> None:
        self.client_events[kind] += 1

    def notify(self) -> None:
        """Wake whoever waits in `until` (call after anything it may be waiting for)."""

        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(wake())

    async def until(self, step: str, predicate: Callable[[], Any], timeout: float | None = None):
        """Wait until `predicate()` is truthy (re-checked on every notify), or fail `step`."""

        async def wait() -> Any:
            async with self._changed:
                while not (value := predicate()):
                    await self._changed.wait()
                return value

        try:
            return await asyncio.wait_for(wait(), timeout or self.step_timeout)
        except TimeoutError:
            raise StepFailed(step, f"timed out after {timeout or self.step_timeout:.0f}s") from None

    def step(self, name: str, **facts: Any) -> None:
        self.steps[name] = facts

    def result(self) -> dict[str, Any]:
        return {
            "framework": self.framework,
            "scenario": self.scenario,
            "model": self.model,
            "steps": self.steps,
            "failed_step": self.failed_step,
            "exception": self.exception,
            "warnings": self.warnings.records,
            "errors": self.errors,
            "server_events": dict(self.server_events),
            "ga_problems": self.ga_problems,
            "client_events": dict(self.client_events),
            "user_transcripts": self.user_transcripts,
            "trace": self.trace,
            "seconds": round(time.monotonic() - self.started, 2),
        }


class StepFailed(Exception):
    def __init__(self, step: str, why: str) -> None:
        super().__init__(f"{step}: {why}")
        self.step = step


def run(framework: str, main: Callable[[argparse.Namespace, Report], Awaitable[None]]) -> None:
    """Run `main(args, report)` and print the report as the last line of stdout."""
    run_report(Report(framework, parse_args(framework)), main)


def run_report(report: Report, main: Callable[[argparse.Namespace, Any], Awaitable[None]]) -> None:
    """Run `main(report.args, report)` (a scenario with arguments and a report of its own)
    and print the report as the last line of stdout."""
    args = report.args

    async def runner() -> dict[str, Any]:
        try:
            await main(args, report)
        except StepFailed as failed:
            report.failed_step = failed.step
            report.exception = str(failed)
        except BaseException as error:  # report whatever the framework raised
            report.failed_step = report.failed_step or "exception"
            report.exception = "".join(traceback.format_exception(error))[-4000:]
        return report.result()

    result = asyncio.run(runner())
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
