"""OpenBMB's realtime SDK, `openbmb_realtime` 0.1.6 as its wheel ships it (unchanged, never
copied here), against `duplex serve --plugin minicpmo` on the tiny MiniCPM-o checkpoint: the
SDK's own model, one scenario a run, its facts printed as one JSON line for
tests/map_client/test_minicpmo_map_client.py to judge.

    .venv-map/bin/python tests/map_client/clients/minicpmo_map_client.py \\
        --url http://127.0.0.1:8000 --key KEY --model minicpmo --scenario audio \\
        --audio voice.f32 --jpeg frame.jpg

The audio is the file --audio names: float32 mono at 16 kHz, as the SDK sends it (a voice the
tiny model answers, then quiet: harness/minicpmo_sounds.py), sent in 100 ms chunks at a
microphone's pace and looped while a scenario waits for the model. The connection is
recorded as map_client.py does (its `Recorder` and `Events`, imported from there); every
wait is for an event, bounded by --step-timeout.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import json
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from map_client import Events, Recorder, StepFailed, chunks
from openbmb_realtime import (
    AudioDelta,
    ErrorEvent,
    RealtimeClient,
    RealtimeConfig,
    SessionClosed,
    TextDelta,
    TurnCompleted,
    __version__,
)

CHUNK_S = 0.1


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.facts: dict[str, Any] = {"sdk_version": __version__}
        self.recorders: list[Recorder] = []
        with open(args.audio, "rb") as file:
            self.audio = file.read()
        with open(args.jpeg, "rb") as file:
            self.frame = file.read()

    def client(self) -> tuple[RealtimeClient, Recorder]:
        recorder = Recorder()
        self.recorders.append(recorder)
        client = RealtimeClient(
            api_key=self.args.key,
            base_url=self.args.url,
            connect_timeout=self.args.step_timeout,
            websocket_factory=recorder.factory,
        )
        return client, recorder

    def fact(self, **facts: Any) -> None:
        self.facts.update(facts)


@contextlib.asynccontextmanager
async def microphone(send: Callable[[bytes], Awaitable[None]], audio: bytes):
    """The voice looped in 100 ms chunks at a microphone's pace (the model's clock is real
    time) until the block ends."""

    async def loop() -> None:
        while True:
            for chunk in chunks(audio):
                await send(chunk)
                await asyncio.sleep(CHUNK_S)

    task = asyncio.create_task(loop())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def heard(events: Events) -> dict[str, Any]:
    """The model's audio as the SDK gave it: bytes, float32 samples, how loud."""
    samples = array.array("f")
    for delta in events.of(AudioDelta):
        samples.frombytes(delta.audio)
    return {
        "deltas": len(events.of(AudioDelta)),
        "samples": len(samples),
        "max_delta_bytes": max((len(d.audio) for d in events.of(AudioDelta)), default=0),
        "peak": round(max((abs(s) for s in samples), default=0.0), 3),
        "finite": all(s == s and abs(s) <= 1.0 for s in samples),
    }


async def audio(run: Run) -> None:
    """mode=audio: connect, speak, hear the model's answer to its end, close."""
    client, wire = run.client()
    session = await client.audio.connect(model=run.args.model, system_prompt="Be brief.")
    events = Events(session)
    run.fact(session_id=session.id, state_after_connect=session.state.value)
    async with microphone(session.send_audio, run.audio):
        await events.until("the answer", lambda: events.of(TurnCompleted), run.args.step_timeout)
    run.fact(
        heard=heard(events),
        texts=[e.text for e in events.of(TextDelta)],
        kinds=sorted({e.get("kind") for e in wire.received("response.output.delta")}),
        done=[e["response"]["status"] for e in wire.received("response.done")],
    )
    await session.close()
    await events.until("closed", lambda: events.of(SessionClosed), run.args.step_timeout)
    run.fact(
        subprotocol=wire.subprotocol,
        init=wire.sent("session.init")[0],
        events=events.names(),
        errors=[e.code for e in events.of(ErrorEvent)],
        warnings=[w["warning"]["code"] for w in wire.received("warning")],
        state_after_close=session.state.value,
        received=wire.types("in"),
    )


async def video(run: Run) -> None:
    """mode=video: the JPEG with every chunk of audio (send_audio_video); the model
    answers, and (the test reads) sees it."""
    client, wire = run.client()
    session = await client.video.connect(
        model=run.args.model, config=RealtimeConfig(vision_hd=False)
    )
    events = Events(session)

    async def with_frame(chunk: bytes) -> None:
        await session.send_audio_video(chunk, run.frame)

    async with microphone(with_frame, run.audio):
        await events.until("the answer", lambda: events.of(TurnCompleted), run.args.step_timeout)
    appends = wire.sent("input.append")
    run.fact(
        mode=wire.sent("session.init")[0],
        heard=heard(events),
        texts=[e.text for e in events.of(TextDelta)],
        frames_per_append=sorted({len(e["input"].get("video_frames", [])) for e in appends}),
        errors=[e.code for e in events.of(ErrorEvent)],
        warnings=[w["warning"]["code"] for w in wire.received("warning")],
    )
    await session.close()


async def interrupt(run: Run) -> None:
    """`interrupt()` while the model speaks: the next append carries force_listen, the
    model's response ends cancelled, and the model is heard again after it."""
    client, wire = run.client()
    session = await client.audio.connect(model=run.args.model)
    events = Events(session)
    async with microphone(session.send_audio, run.audio):
        await events.until("speech", lambda: events.of(AudioDelta), run.args.step_timeout)
        session.interrupt()

        def cancelled() -> bool:
            done = wire.received("response.done")
            return any(e["response"]["status"] == "cancelled" for e in done)

        await wire.until("the cut", cancelled, run.args.step_timeout)
        cut_at = len(events.seen)
        await events.until(
            "heard again",
            lambda: any(isinstance(e, AudioDelta) for e in events.seen[cut_at:]),
            run.args.step_timeout,
        )
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


SCENARIOS: dict[str, Callable[[Run], Awaitable[None]]] = {
    "audio": audio,
    "video": video,
    "interrupt": interrupt,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True, help="the server's HTTP base URL")
    parser.add_argument("--key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    parser.add_argument("--audio", required=True, help="float32 mono 16 kHz, raw")
    parser.add_argument("--jpeg", required=True, help="a JPEG camera frame")
    parser.add_argument("--step-timeout", type=float, default=60.0)
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
