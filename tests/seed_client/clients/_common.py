"""What the seed client's scenarios share: a recording transport for DuplexClient's `connect=`
hook (every frame each connection carried, in order, and a switch that makes the network go
away), waits bounded by a timeout, the audio the scenarios say, and the one JSON line each
run prints.

Runs in .venv-seed (never the project's venv): the standard library, `websockets` and
vLLM-Omni's `vllm_omni.clients` package, extracted from its wheel (`make test-seed-client`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import websockets
from vllm_omni.clients.duplex import (
    DuplexClient,
    ResponseHandle,
    SessionConfig,
    WebSocketTransport,
    read_pcm16_wav,
)

#: the client's own input format (SessionConfig's default): 16 kHz mono pcm16
BYTES_PER_MS = 32
#: what DuplexClient's default transport allows (vllm_omni.clients.duplex._MAX_FRAME_BYTES)
MAX_FRAME_BYTES = 64 << 20
#: event types whose runs the trace folds into one entry
DELTAS = frozenset(
    {
        "response.output_audio.delta",
        "response.output_audio_transcript.delta",
        "playback.acknowledged",
    }
)


class StepFailed(Exception):
    def __init__(self, step: str, why: str) -> None:
        super().__init__(f"{step}: {why}")
        self.step = step


class Frames:
    """Wakes whoever waits for a condition on the frames (see `until`)."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    def changed(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def until(self, what: str, predicate: Callable[[], Any], timeout: float) -> Any:
        """`predicate()` once it is truthy, re-checked at every frame; StepFailed after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StepFailed(what, f"not seen within {timeout:.0f}s")
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, remaining)
        return value


class RecordingTransport(WebSocketTransport):
    """One websockets connection, every frame it carries recorded (DuplexClient's transport
    interface: send, recv, close), and `abort()`: the socket drops with no close frame."""

    def __init__(self, recorder: Recorder, ws: Any, index: int) -> None:
        self.recorder = recorder
        self.ws = ws
        self.index = index

    async def send(self, data: str) -> None:
        self.recorder.record(self.index, "out", data)
        await self.ws.send(data)

    async def recv(self) -> str | bytes:
        data = await self.ws.recv()
        self.recorder.record(self.index, "in", data)
        return data

    async def close(self) -> None:
        await self.ws.close()

    def abort(self) -> None:
        self.ws.transport.abort()


class Recorder(Frames):
    """The connections one DuplexClient made (its `connect=`), and their frames in order."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.connections: list[RecordingTransport] = []
        #: (connection index, "in" or "out", the decoded event)
        self.frames: list[tuple[int, str, dict[str, Any]]] = []
        #: True: every new connection fails, as when the network is down
        self.offline = False
        self.refused = 0

    async def connect(self, url: str) -> WebSocketTransport:
        if self.offline:
            self.refused += 1
            raise OSError(f"{self.name}: the network is down (the test said so)")
        ws = await websockets.connect(url, max_size=MAX_FRAME_BYTES)
        transport = RecordingTransport(self, ws, len(self.connections))
        self.connections.append(transport)
        self.changed()
        return transport

    def record(self, index: int, direction: str, data: str | bytes) -> None:
        try:
            event = json.loads(data)
        except ValueError:
            event = {"type": f"<{len(data)} bytes that are not JSON>"}
        self.frames.append((index, direction, event if isinstance(event, dict) else {}))
        self.changed()

    def received(self, connection: int | None = None) -> list[dict[str, Any]]:
        """Server events, in order (on one connection, or on all)."""
        return [
            event
            for index, direction, event in self.frames
            if direction == "in" and connection in (None, index)
        ]

    def sent(self, connection: int | None = None) -> list[dict[str, Any]]:
        return [
            event
            for index, direction, event in self.frames
            if direction == "out" and connection in (None, index)
        ]

    def first(self, kind: str, connection: int | None = None) -> dict[str, Any] | None:
        return next((e for e in self.received(connection) if e.get("type") == kind), None)

    def of_type(self, kind: str, connection: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.received(connection) if e.get("type") == kind]

    async def wait_type(self, kind: str, timeout: float, connection: int | None = None):
        return await self.until(
            f"{self.name}: {kind}", lambda: self.first(kind, connection), timeout
        )

    def trace(self) -> list[str]:
        """`<name><connection>:<type>#<seq>` per server event, runs of deltas folded."""
        out: list[str] = []
        run_key, run_count = None, 0
        for index, direction, event in self.frames:
            if direction != "in":
                continue
            kind = str(event.get("type"))
            if kind in DELTAS:
                key = (index, kind)
                if key == run_key:
                    run_count += 1
                    out[-1] = f"{self.name}{index}:{kind} x{run_count}"
                    continue
                run_key, run_count = key, 1
            else:
                run_key = None
            if kind == "response.done":
                response = event.get("response") or {}
                details = response.get("status_details") or {}
                kind = f"{kind}:{response.get('status')}:{details.get('reason')}"
            elif kind == "error":
                kind = f"error:{(event.get('error') or {}).get('code')}"
            seq = event.get("server_event_seq")
            out.append(f"{self.name}{index}:{kind}" + (f"#{seq}" if seq is not None else ""))
        return out


class Report:
    """What a run prints: the scenario's facts, and what each connection carried."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.facts: dict[str, Any] = {}
        self.recorders: list[Recorder] = []
        self.failed_step: str | None = None
        self.exception: str | None = None
        self.started = time.monotonic()

    def recorder(self, name: str) -> Recorder:
        recorder = Recorder(name)
        self.recorders.append(recorder)
        return recorder

    def client(
        self, name: str, config: SessionConfig, **options: Any
    ) -> tuple[DuplexClient, Recorder]:
        """An unchanged DuplexClient whose connections `name`'s recorder makes."""
        recorder = self.recorder(name)
        client = DuplexClient(
            self.args.url,
            model=self.args.model,
            config=config,
            connect=recorder.connect,
            handshake_timeout_s=self.args.step_timeout,
            **options,
        )
        return client, recorder

    def fact(self, **facts: Any) -> None:
        self.facts.update(facts)

    def result(self) -> dict[str, Any]:
        return {
            "seed_client": self.args.scenario,
            "facts": self.facts,
            "failed_step": self.failed_step,
            "exception": self.exception,
            "errors": [
                event.get("error")
                for recorder in self.recorders
                for event in recorder.of_type("error")
            ],
            "trace": [line for recorder in self.recorders for line in recorder.trace()],
            "seconds": round(time.monotonic() - self.started, 2),
        }


async def within(step: str, awaitable: Awaitable[Any], timeout: float) -> Any:
    """`awaitable`'s result, or StepFailed after `timeout` seconds."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        raise StepFailed(step, f"no result within {timeout:.0f}s") from None


async def next_response(client: DuplexClient, step: str, timeout: float) -> ResponseHandle:
    """The next response that speaks, from `client.responses()` (listen decisions are
    skipped, as the client's own docstring example does)."""

    async def first() -> ResponseHandle:
        responses: AsyncIterator[ResponseHandle] = client.responses()
        async with contextlib.aclosing(responses):
            async for response in responses:
                if response.decision == "listen":
                    continue
                return response
        raise StepFailed(step, "the session ended before a response")

    return await within(step, first(), timeout)


async def play(
    client: DuplexClient,
    response: ResponseHandle,
    step: str,
    timeout: float,
    until_ms: float | None = None,
    ack: bool = False,
) -> None:
    """Take the response's audio as a player would (acking it when `ack`), to its end or
    until `until_ms` of it was taken."""

    async def take() -> None:
        chunks = response.audio()
        async with contextlib.aclosing(chunks):
            async for _ in chunks:
                if ack:
                    await client.ack_playback(response.played_ms)
                if until_ms is not None and response.played_ms >= until_ms:
                    return
        if until_ms is not None:
            raise StepFailed(step, f"the response ended after {response.played_ms:.0f} ms")

    await within(step, take(), timeout)


def summary(response: ResponseHandle) -> dict[str, Any]:
    """A response as the client saw it: decision, status and reason, audio and transcript."""
    done = response.done_event.raw if response.done_event is not None else {}
    body = done.get("response") if isinstance(done.get("response"), dict) else {}
    details = body.get("status_details") if isinstance(body.get("status_details"), dict) else {}
    return {
        "id": response.response_id,
        "decision": response.decision,
        "finished": response.finished,
        "done_type": done.get("type"),
        "status": body.get("status"),
        "reason": details.get("reason"),
        "audio_ms": round(response.played_ms, 1),
        "transcript": response.transcript,
    }


def speech(args: argparse.Namespace) -> bytes:
    """'Hello there, can you hear me?' (2.2 s, 16 kHz pcm16): real speech, which the
    server's VAD (Silero) hears, read with the client's own WAV reader."""
    return read_pcm16_wav(Path(args.speech))


def silence(ms: int) -> bytes:
    return bytes(BYTES_PER_MS * ms)


def parse_args(scenarios: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="vLLM-Omni's DuplexClient against duplex serve")
    parser.add_argument("--url", required=True, help="ws://HOST:PORT of duplex serve")
    parser.add_argument("--model", default="echo")
    parser.add_argument("--scenario", required=True, choices=scenarios)
    parser.add_argument("--speech", required=True, help="a mono 16 kHz pcm16 WAV of speech")
    parser.add_argument("--step-timeout", type=float, default=30.0)
    return parser.parse_args()


def run(scenarios: dict[str, Callable[[argparse.Namespace, Report], Awaitable[None]]]) -> None:
    """Run the named scenario and print its report as the last line of stdout."""
    args = parse_args(sorted(scenarios))

    async def runner() -> dict[str, Any]:
        report = Report(args)
        try:
            await scenarios[args.scenario](args, report)
        except StepFailed as failed:
            report.failed_step = failed.step
            report.exception = str(failed)
        except BaseException as error:  # whatever the client raised, with its traceback
            report.failed_step = report.failed_step or "exception"
            report.exception = "".join(traceback.format_exception(error))[-4000:]
        return report.result()

    result = asyncio.run(runner())
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
