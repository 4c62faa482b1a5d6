"""LiveKit's PersonaPlex plugin as a client of duplex serve: `livekit-plugins-nvidia`'s
`experimental.realtime.RealtimeModel` and its RealtimeSession, without a LiveKit server (audio
frames are pushed to the session and read from its generations, as AgentSession does with a
room's tracks), on the Moshi binary protocol of `/api/chat`.

The plugin cannot send headers: the API key is in the base URL's path (`/key/<KEY>`), the only
place it can carry one. The scenario, against a server of one session slot:

- `refused`: a session with a wrong key is refused on the upgrade (the plugin gives up);
- `first`: a session's first generation brings audio and text back;
- `interrupt`: `session.interrupt()` while that generation is active ends it, and the model's
  next audio starts a new generation;
- `second`: after `aclose()`, a new session on the same model gets audio back (the slot of the
  first was freed);
- `first_stream`, `second_stream`: each session streams on for STREAM_FRAMES frames, then its
  microphone stops, and what it got is summed up: its generations, how each ended, and the
  frames back for the frames sent.

How many generations a session makes is the server's doing: the plugin starts one on the
first audio or text after the last ended, and ends it on `interrupt()` or after 500 ms
without an audio message (its `silence_threshold_ms`: without a message, not without sound).
A server that sends a frame per frame the client sent, the model's silence included, as
kyutai's `moshi.server` 0.2.13 does, keeps one generation for as long as the microphone
runs: one per session, and one more per interruption. Measured against moshi.server on the
tiny Moshi checkpoint: 2 generations (1 interruption) for 43 frames sent, 42 back; then 1
for 42 sent, 41 back; the longest wait between frames 92 ms. A server that sends nothing
while its model listens gives one generation per model turn.

The plugin holds the audio pushed before the handshake and sends it all at once after it.
Against PersonaPlex on the tiny checkpoint the handshake waits for the prompt (the voice,
the persona, their silences: about 6.5 s, 81 frames), and duplex serve steps such a backlog
(up to 10 s of it) between its ticks, as fast as the worker has time (docs/models.md): all
81 frames come back, then one per frame.

    .venv-frameworks/bin/python tests/frameworks/clients/personaplex_client.py \
        --url http://127.0.0.1:8000 --api-key KEY
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np
from _common import RATE, Microphone, Report, StepFailed, run_report
from livekit import rtc
from livekit.agents import llm, utils
from livekit.plugins.nvidia.experimental.realtime import RealtimeModel

FRAMEWORK = "personaplex"
#: Moshi's frame: 80 ms at 24 kHz, a step of the model per frame of the client's audio
FRAME = 1920
#: how long the audio must stay quiet, once the microphone stopped, to call the stream over
SETTLE_S = 1.5
#: how many frames a session streams on after its checks, before its stream is summed up:
#: 3.2 s, several times the plugin's 500 ms end of a generation without audio
STREAM_FRAMES = 40
PERSONA = "You are a wise and friendly teacher. Answer questions clearly."


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="LiveKit's PersonaPlex plugin against duplex")
    parser.add_argument("--url", required=True, help="http://HOST:PORT of duplex serve")
    parser.add_argument("--api-key", required=True, help="a key the server accepts")
    parser.add_argument("--voice", default="NATF2")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--step-timeout", type=float, default=60.0)
    args = parser.parse_args()
    args.scenario, args.model = "personaplex", "moshi"  # what Report records
    return args


@dataclass
class Generation:
    """One generation as the client saw it: what its streams carried, and whether they ended."""

    id: str
    audio_samples: int = 0
    audio_peak: int = 0
    text: str = ""
    ended: bool = False
    #: ended by our session.interrupt() (else by the plugin: 500 ms without audio, or the close)
    interrupted: bool = False
    #: the longest wait between two of its audio frames, as this client read them
    max_gap_ms: float = 0.0
    last_audio_at: float | None = None
    readers: list[asyncio.Task[None]] = field(default_factory=list)
    #: the streams themselves (utils.aio.Chan), to tell synchronously whether they were closed
    streams: list[Any] = field(default_factory=list)

    def active(self) -> bool:
        return bool(self.streams) and not any(s.closed for s in self.streams)

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "audio_samples": self.audio_samples,
            "audio_peak": self.audio_peak,
            "text": self.text[:400],
            "ended": self.ended,
            "interrupted": self.interrupted,
            "max_gap_ms": round(self.max_gap_ms),
        }


class Client:
    """One RealtimeSession and what it emitted."""

    def __init__(self, model: RealtimeModel, report: Report, label: str) -> None:
        self.report = report
        self.label = label
        self.session = model.session()
        self.generations: list[Generation] = []
        self.errors: list[dict[str, Any]] = []
        #: the audio pushed into the session (pcm16 samples at 24 kHz), and when audio came last
        self.pushed_samples = 0
        #: what was pushed before the server's handshake (the plugin holds it until then)
        self.pushed_before_handshake: int | None = None
        self.last_audio_at = time.monotonic()
        self.session.on("generation_created", self._generation)
        self.session.on("error", self._error)

    def _error(self, event: llm.RealtimeModelError) -> None:
        self.errors.append(
            {
                "error": f"{type(event.error).__name__}: {event.error}"[:600],
                "recoverable": event.recoverable,
            }
        )
        self.report.errors.append(f"{self.label}: {self.errors[-1]}")
        self.report.notify()

    def _generation(self, event: llm.GenerationCreatedEvent) -> None:
        generation = Generation(event.response_id)
        self.generations.append(generation)
        self.report.client_event(f"{self.label}:generation_created")
        task = asyncio.get_running_loop().create_task(self._read(event, generation))
        task.add_done_callback(lambda _: self.report.notify())
        self.report.notify()

    async def _read(self, event: llm.GenerationCreatedEvent, generation: Generation) -> None:
        async for message in event.message_stream:
            generation.streams += [message.audio_stream, message.text_stream]
            generation.readers.append(asyncio.create_task(self._audio(message, generation)))
            generation.readers.append(asyncio.create_task(self._text(message, generation)))
            self.report.notify()
        async for _call in event.function_stream:
            pass
        await asyncio.gather(*generation.readers)
        generation.ended = True

    async def _audio(self, message: llm.MessageGeneration, generation: Generation) -> None:
        async for frame in message.audio_stream:
            now = time.monotonic()
            if generation.last_audio_at is not None:
                gap_ms = 1000 * (now - generation.last_audio_at)
                generation.max_gap_ms = max(generation.max_gap_ms, gap_ms)
            generation.last_audio_at = self.last_audio_at = now
            samples = np.frombuffer(frame.data, dtype=np.int16)
            generation.audio_samples += frame.samples_per_channel
            if samples.size:
                generation.audio_peak = max(generation.audio_peak, int(np.abs(samples).max()))
            self.report.notify()

    async def _text(self, message: llm.MessageGeneration, generation: Generation) -> None:
        async for text in message.text_stream:
            generation.text += text
            self.report.notify()

    def push(self, pcm: bytes) -> None:
        if self.pushed_before_handshake is None and self.session._handshake_event.is_set():
            self.pushed_before_handshake = self.pushed_samples
        self.pushed_samples += len(pcm) // 2
        self.report.notify()
        frame = rtc.AudioFrame(
            data=pcm, sample_rate=RATE, num_channels=1, samples_per_channel=len(pcm) // 2
        )
        self.session.push_audio(frame)

    def latest(self) -> Generation | None:
        return self.generations[-1] if self.generations else None

    async def stream_summary(self, step: str, mic: Microphone) -> dict[str, Any]:
        """Let the microphone run for STREAM_FRAMES more frames, stop it, wait until the
        stream is over (no audio for SETTLE_S, the last generation ended by the plugin's
        silence timer), and say what the session got: a frame back per frame sent makes one
        stream, and one stream one generation (every other started by an interruption)."""
        mark = self.pushed_samples + STREAM_FRAMES * FRAME
        await self.until(step, lambda: self.pushed_samples >= mark)
        await mic.stop()
        stopped = time.monotonic()
        await self.until(
            step,
            lambda: (
                time.monotonic() - max(self.last_audio_at, stopped) > SETTLE_S
                and all(g.ended for g in self.generations)
            ),
            poll=True,
        )
        received = sum(g.audio_samples for g in self.generations)
        interruptions = sum(g.interrupted for g in self.generations)
        return {
            "generations": len(self.generations),
            "interruptions": interruptions,
            # one stream (a generation, and one more per interruption), or a model's turns
            "generations_per": (
                "session" if len(self.generations) == 1 + interruptions else "turn"
            ),
            "frames_sent": self.pushed_samples // FRAME,
            "frames_sent_before_handshake": (self.pushed_before_handshake or 0) / FRAME,
            "frames_back": received / FRAME,
            "max_gap_ms": round(max((g.max_gap_ms for g in self.generations), default=0)),
            "each": [g.summary() for g in self.generations],
        }

    async def until(self, step: str, predicate: Any, poll: bool = False) -> Any:
        """Wait for `predicate()`, or fail `step` at once on an error event of the session
        (`poll`: a predicate of the clock, which no event wakes, is also re-checked on a
        timer)."""
        ticker = asyncio.create_task(self._tick()) if poll else None
        try:
            result = await self.report.until(step, lambda: self.errors or predicate())
        finally:
            if ticker is not None:
                ticker.cancel()
        if self.errors:
            raise StepFailed(step, f"error event: {self.errors[0]}")
        return result

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            self.report.notify()


def user_speech(seconds: float, seed: int) -> bytes:
    """Noise-like user audio (what the tiny model is tested with), pcm16 at 24 kHz."""
    rng = np.random.default_rng(seed)
    samples = 0.2 * rng.standard_normal(int(seconds * RATE))
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def check(step: str, condition: bool, why: str) -> None:
    if not condition:
        raise StepFailed(step, why)


async def main(args: argparse.Namespace, report: Report) -> None:
    base = args.url.replace("http", "ws", 1).rstrip("/")
    # outside a LiveKit job: what the plugin's http_session() needs (its own advice)
    async with utils.http_context.open():
        await refused(args, report, base)
        # nothing below may log a warning or an error (the refusal above logs its own)
        report.steps["log_records_before_sessions"] = len(report.warnings.records)
        model = RealtimeModel(
            base_url=f"{base}/key/{args.api_key}",
            voice=args.voice,
            text_prompt=PERSONA,
            seed=args.seed,
        )
        try:
            await first_and_interrupt(model, report)
            await second(model, report)
        finally:
            await model.aclose()


async def refused(args: argparse.Namespace, report: Report, base: str) -> None:
    """A wrong key: the upgrade is refused, the plugin reports an error it will not retry."""
    model = RealtimeModel(base_url=f"{base}/key/not-{args.api_key}", voice=args.voice)
    client = Client(model, report, "refused")
    try:
        await report.until("refused", lambda: client.errors)
        report.step("refused", errors=client.errors, generations=len(client.generations))
        check("refused", not client.errors[0]["recoverable"], "the plugin will retry this")
    finally:
        await client.session.aclose()
        await model.aclose()
    report.errors.clear()  # expected here; any later error event is a failure


async def first_and_interrupt(model: RealtimeModel, report: Report) -> None:
    client = Client(model, report, "first")
    mic = Microphone(client.push, idle_silence=True).start()
    speaking = mic.saying(user_speech(120, seed=1))
    try:
        first = await client.until(
            "first", lambda: (g := client.latest()) and g.audio_samples > 0 and g.text.strip() and g
        )
        # the plugin sends no audio before the server's handshake byte (0x00): whether it came
        # (the plugin keeps it in a private event; nothing public tells); and the voice it
        # asked for, a `.pt` name (its URL, from its private builder)
        query = parse_qs(urlsplit(client.session._build_ws_url()).query)
        report.step(
            "first",
            handshake=client.session._handshake_event.is_set(),
            voice_prompt=query.get("voice_prompt", [""])[0],
            **first.summary(),
        )

        # an interruption while a generation is active: checked and made in one turn of the
        # loop (the plugin also ends a generation after 500 ms without audio); the plugin ends
        # it (nothing goes to the server), and the model's next audio starts a new one
        def interrupt_active() -> Generation | None:
            generation = client.latest()
            if generation is None or not generation.active() or not generation.audio_samples:
                return None
            client.session.interrupt()
            generation.interrupted = True
            return generation

        interrupted = await client.until("interrupt", interrupt_active)
        await client.until("interrupt", lambda: interrupted.ended)
        after = await client.until(
            "interrupt",
            lambda: (g := client.latest()) is not interrupted and g.audio_samples > 0 and g,
        )
        report.step(
            "interrupt",
            interrupted=interrupted.summary(),
            interrupted_first=interrupted is first,
            next=after.summary(),
        )
        report.step("first_stream", **await client.stream_summary("first_stream", mic))
    finally:
        speaking.cancel()
        await mic.stop()
        await client.session.aclose()


async def second(model: RealtimeModel, report: Report) -> None:
    """Right after the first session's aclose(): the one slot must be free again."""
    client = Client(model, report, "second")
    mic = Microphone(client.push, idle_silence=True).start()
    speaking = mic.saying(user_speech(60, seed=2))
    try:
        generation = await client.until(
            "second", lambda: (g := client.latest()) and g.audio_samples > 0 and g
        )
        report.step("second", **generation.summary())
        report.step("second_stream", **await client.stream_summary("second_stream", mic))
    finally:
        speaking.cancel()
        await mic.stop()
        await client.session.aclose()


def run() -> None:
    """Run the scenario and print what it saw as the last line of stdout."""
    run_report(Report(FRAMEWORK, parse_args()), main)


if __name__ == "__main__":
    run()
