"""OpenBMB's realtime SDK, `openbmb_realtime` 0.1.6 as its wheel ships it (unchanged, never
copied here), against duplex serve: one scenario a run, its facts printed as one JSON line
for tests/map_client to judge.

    .venv-map/bin/python tests/map_client/clients/map_client.py --url http://127.0.0.1:8000 \\
        --key KEY --model frame_echo_seeing --scenario audio --jpeg /tmp/frame.jpg

The SDK is used through its public API: `RealtimeClient(...).audio.connect(...)` /
`.video.connect(...)`, `send_audio`, `send_audio_base64`, `send_audio_video`, `interrupt`,
`close`, its events. Its `websocket_factory` parameter (public: the SDK offers it for
tests) is given its own default factory, wrapped to record every frame the connection
carries, so that a run can say what went over the wire too, and send what the SDK never
would (a frame that is not JSON). Audio is float32 mono at 16 kHz built with the standard
library (this venv has the SDK and websockets only); every wait is for an event, bounded by
--step-timeout.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import base64
import contextlib
import json
import math
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from openbmb_realtime import (
    AudioDelta,
    ErrorEvent,
    RealtimeClient,
    RealtimeConfig,
    RealtimeError,
    SessionClosed,
    SessionQueued,
    SessionReady,
    TextDelta,
    TurnCompleted,
    __version__,
)
from openbmb_realtime.transport import default_websocket_factory

RATE_IN = 16_000
CHUNK_S = 0.1


class StepFailed(Exception):
    def __init__(self, step: str, why: str) -> None:
        super().__init__(f"{step}: {why}")
        self.step = step


# ---------------------------------------------------------------- the wire, recorded


class Recorded:
    """One connection the SDK made, every frame recorded: the SDK's transport interface
    (send, recv, close) over the connection its own default factory made."""

    def __init__(self, recorder: Recorder, ws: Any) -> None:
        self.recorder = recorder
        self.ws = ws

    async def send(self, message: str) -> None:
        self.recorder.frames.append(("out", _decoded(message)))
        await self.ws.send(message)

    async def recv(self) -> str | bytes:
        message = await self.ws.recv()
        self.recorder.frames.append(("in", _decoded(message)))
        self.recorder.changed()
        return message

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self.ws.close(code, reason)


def _decoded(message: str | bytes) -> dict[str, Any]:
    try:
        event = json.loads(message)
    except ValueError:
        return {"type": f"<{len(message)} bytes that are not JSON>"}
    return event if isinstance(event, dict) else {"type": "<not an object>"}


class Recorder:
    def __init__(self) -> None:
        self.frames: list[tuple[str, dict[str, Any]]] = []
        self.connection: Recorded | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self.subprotocol: str | None = None

    async def factory(self, url: str, **options: Any) -> Recorded:
        ws = await default_websocket_factory(url, **options)
        self.subprotocol = ws.subprotocol
        self.connection = Recorded(self, ws)
        return self.connection

    def changed(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    def received(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for d, e in self.frames if d == "in" and kind in (None, e.get("type"))]

    def sent(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for d, e in self.frames if d == "out" and kind in (None, e.get("type"))]

    async def until(self, step: str, predicate: Callable[[], Any], timeout: float) -> Any:
        """`predicate()` once it is truthy, checked at every frame received."""
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StepFailed(step, f"not seen within {timeout:.0f}s")
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await waiter
        return value

    def types(self, direction: str) -> list[str]:
        """The types of the frames one way, runs of one type folded (`type xN`)."""
        out: list[str] = []
        for d, event in self.frames:
            if d != direction:
                continue
            kind = str(event.get("type"))
            last = out[-1].split(" x")[0] if out else None
            if kind == last:
                count = int(out[-1].split(" x")[1]) if " x" in out[-1] else 1
                out[-1] = f"{kind} x{count + 1}"
            else:
                out.append(kind)
        return out


# ---------------------------------------------------------------- the SDK's events, collected


class Events:
    """The session's normalised events (the SDK's `async for event in session`)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.seen: list[Any] = []
        self._changed = asyncio.Event()
        self.task = asyncio.create_task(self._consume())

    async def _consume(self) -> None:
        async for event in self.session:
            self.seen.append(event)
            self._changed.set()
        self._changed.set()

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.seen if isinstance(e, kind)]

    async def until(self, step: str, predicate: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.task.done():  # or the session's events ended
                raise StepFailed(step, f"not seen within {timeout:.0f}s: {self.names()[-12:]}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
        return value

    def names(self) -> list[str]:
        return [type(e).__name__ for e in self.seen]

    def heard(self) -> dict[str, Any]:
        """The model's audio as the SDK gave it: float32 samples, how many, how loud."""
        samples = array.array("f")
        for delta in self.of(AudioDelta):
            samples.frombytes(delta.audio)
        return {
            "deltas": len(self.of(AudioDelta)),
            "samples": len(samples),
            "bytes_per_delta": sorted({len(d.audio) for d in self.of(AudioDelta)}),
            "peak": round(max((abs(s) for s in samples), default=0.0), 3),
        }


# ---------------------------------------------------------------- audio


def tone(seconds: float, amplitude: float = 0.3) -> bytes:
    """A 440 Hz tone as the SDK takes audio: float32 mono at 16 kHz (native byte order,
    little-endian here)."""
    count = int(seconds * RATE_IN)
    step = 2 * math.pi * 440 / RATE_IN
    return array.array("f", (amplitude * math.sin(step * n) for n in range(count))).tobytes()


def silence(seconds: float) -> bytes:
    return bytes(4 * int(seconds * RATE_IN))


def chunks(audio: bytes) -> list[bytes]:
    size = 4 * int(CHUNK_S * RATE_IN)
    return [audio[i : i + size] for i in range(0, len(audio), size)]


async def speak(send: Callable[[bytes], Awaitable[None]], audio: bytes) -> None:
    """At a microphone's pace (the model's clock is real time)."""
    for chunk in chunks(audio):
        await send(chunk)
        await asyncio.sleep(CHUNK_S)


# ---------------------------------------------------------------- scenarios


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.facts: dict[str, Any] = {"sdk_version": __version__}
        self.recorders: list[Recorder] = []

    def client(self, key: str | None = None) -> tuple[RealtimeClient, Recorder]:
        recorder = Recorder()
        self.recorders.append(recorder)
        client = RealtimeClient(
            api_key=key or self.args.key,
            base_url=self.args.url,
            connect_timeout=self.args.step_timeout,
            websocket_factory=recorder.factory,
        )
        return client, recorder

    def fact(self, **facts: Any) -> None:
        self.facts.update(facts)


async def audio(run: Run) -> None:
    """Connect, say something, hear it back, close."""
    client, wire = run.client()
    session = await client.audio.connect(model=run.args.model, system_prompt="Be brief.")
    events = Events(session)
    run.fact(session_id=session.id, state_after_connect=session.state.value)
    run.fact(subprotocol=wire.subprotocol, init=wire.sent("session.init")[0])
    await speak(session.send_audio, tone(1.0) + silence(0.5))
    await events.until("the answer", lambda: events.of(TurnCompleted), run.args.step_timeout)
    run.fact(heard=events.heard(), texts=[e.text for e in events.of(TextDelta)])
    await session.close()
    await events.until("closed", lambda: events.of(SessionClosed), run.args.step_timeout)
    run.fact(
        events=events.names(),
        closed_reason=events.of(SessionClosed)[0].reason,
        state_after_close=session.state.value,
        sent=wire.types("out"),
        received=wire.types("in"),
    )


async def interrupt(run: Run) -> None:
    """`interrupt()` while the model speaks: the next append says force_listen, and the
    model's response ends cancelled (the SDK sees its turn completed); the model is heard
    again after it."""
    client, wire = run.client()
    session = await client.audio.connect(model=run.args.model)
    events = Events(session)
    talking = asyncio.create_task(speak(session.send_audio, tone(6.0)))
    try:
        await events.until("speech", lambda: events.of(AudioDelta), run.args.step_timeout)
        session.interrupt()

        def cancelled() -> bool:
            done = wire.received("response.done")
            return any(e["response"]["status"] == "cancelled" for e in done)

        await wire.until("the cut", cancelled, run.args.step_timeout)
        await events.until("turn completed", lambda: events.of(TurnCompleted), 5)
        cut_at = len(events.seen)
        await events.until(
            "heard again",
            lambda: any(isinstance(e, AudioDelta) for e in events.seen[cut_at:]),
            run.args.step_timeout,
        )
    finally:
        talking.cancel()
    run.fact(
        force_listen_appends=sum(
            1 for e in wire.sent("input.append") if e["input"].get("force_listen") is True
        ),
        statuses=[e["response"]["status"] for e in wire.received("response.done")],
        interrupted=any(type(e).__name__ == "Interrupted" for e in events.seen),
        errors=[e.code for e in events.of(ErrorEvent)],
        state=session.state.value,
    )
    await session.close()


async def video(run: Run) -> None:
    """A video session: one JPEG with every chunk of audio; the model says which it got."""
    with open(run.args.jpeg, "rb") as file:
        frame = file.read()
    client, wire = run.client()
    session = await client.video.connect(
        model=run.args.model, config=RealtimeConfig(vision_hd=False)
    )
    events = Events(session)
    try:
        await session.send_video_frame(frame)
    except RealtimeError as error:  # the SDK's own rule: video goes with audio
        run.fact(frame_alone=error.code)

    async def with_frame(chunk: bytes) -> None:
        await session.send_audio_video(chunk, frame)

    await speak(with_frame, tone(1.0) + silence(0.5))
    await events.until(
        "what the model saw",
        lambda: any("<jpeg" in e.text for e in events.of(TextDelta)),
        run.args.step_timeout,
    )
    appends = wire.sent("input.append")
    run.fact(
        texts=sorted({e.text for e in events.of(TextDelta)}),
        frames_per_append=sorted({len(e["input"].get("video_frames", [])) for e in appends}),
        same_frame=all(base64.b64decode(e["input"]["video_frames"][0]) == frame for e in appends),
        errors=[e.code for e in events.of(ErrorEvent)],
        warnings=[e["warning"]["code"] for e in wire.received("warning")],
    )
    await session.close()


async def bad_input(run: Run) -> None:
    """What the server refuses, sent through the SDK (and two frames it never sends, on
    its connection): warnings, and the session goes on."""
    client, wire = run.client()
    session = await client.audio.connect(model=run.args.model)
    events = Events(session)
    await session.send_audio_base64("not base64!")
    await session.send_audio(b"\x00" * 5)  # not whole float32 samples
    assert wire.connection is not None
    await wire.connection.send("{not json")
    await wire.connection.send(json.dumps({"type": "dance"}))
    await wire.until(
        "the warnings", lambda: len(wire.received("warning")) >= 4, run.args.step_timeout
    )
    await speak(session.send_audio, tone(1.0) + silence(0.5))
    await events.until("the answer", lambda: events.of(TurnCompleted), run.args.step_timeout)
    run.fact(
        warnings=[
            (w["warning"]["code"], w["warning"].get("param")) for w in wire.received("warning")
        ],
        state=session.state.value,
        errors=[e.code for e in events.of(ErrorEvent)],
        heard=events.heard(),
    )
    await session.close()


async def refused(run: Run) -> None:
    """What the SDK's connect() raises for an open the server refuses."""
    outcomes: dict[str, Any] = {}
    cases: dict[str, tuple[str | None, str, RealtimeConfig | None]] = {
        "temperature": (None, run.args.model, RealtimeConfig(temperature=5.0)),
        "model": (None, "nobody", None),
        "key": ("not-the-key", run.args.model, None),
    }
    for name, (key, model, config) in cases.items():
        client, _ = run.client(key)
        try:
            session = await client.audio.connect(model=model, config=config)
        except RealtimeError as error:
            outcomes[name] = {"code": error.code, "phase": error.phase, "message": error.message}
        else:
            outcomes[name] = {"opened": session.id}
            await session.close()
    run.fact(outcomes=outcomes)


async def queue(run: Run) -> None:
    """Both slots held: a third client waits in the queue (SessionQueued), and gets the
    slot a closing session frees (WorkerAssigned, then SessionReady)."""
    holders = []
    for _ in range(run.args.slots):
        client, _ = run.client()
        holders.append(await client.audio.connect(model=run.args.model))
    client, wire = run.client()
    waiting = asyncio.create_task(client.audio.connect(model=run.args.model))
    try:
        await wire.until("queued", lambda: wire.received("session.queued"), run.args.step_timeout)
        run.fact(init_before_queue_done=bool(wire.sent("session.init")))
        await holders[0].close()
        async with asyncio.timeout(run.args.step_timeout):
            session = await waiting
    finally:
        if not waiting.done():
            waiting.cancel()
    events = Events(session)
    await events.until("ready", lambda: events.of(SessionReady), run.args.step_timeout)
    run.fact(
        events=events.names()[:8],
        queued=[
            [e.position, e.estimated_wait_seconds, e.queue_length] for e in events.of(SessionQueued)
        ],
        received=wire.types("in")[:6],
        session_id=session.id,
    )
    for held in (*holders[1:], session):
        await held.close()


SCENARIOS: dict[str, Callable[[Run], Awaitable[None]]] = {
    "audio": audio,
    "interrupt": interrupt,
    "video": video,
    "bad_input": bad_input,
    "refused": refused,
    "queue": queue,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True, help="the server's HTTP base URL")
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    parser.add_argument("--jpeg", help="a JPEG camera frame (video)")
    parser.add_argument("--slots", type=int, default=2, help="the server's sessions (queue)")
    parser.add_argument("--step-timeout", type=float, default=30.0)
    args = parser.parse_args()

    async def runner() -> dict[str, Any]:
        run = Run(args)
        failed_step, exception = None, None
        try:
            await SCENARIOS[args.scenario](run)
        except StepFailed as failed:
            failed_step, exception = failed.step, str(failed)
        except BaseException as error:  # whatever the SDK raised, with its traceback
            failed_step = "exception"
            exception = "".join(traceback.format_exception(error))[-4000:]
        return {
            "map_client": args.scenario,
            "facts": run.facts,
            "failed_step": failed_step,
            "exception": exception,
            "trace": [f"{d}:{e.get('type')}" for r in run.recorders for d, e in r.frames][-200:],
        }

    result = asyncio.run(runner())
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
