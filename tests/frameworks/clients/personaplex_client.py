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
  first was freed).

    .venv-frameworks/bin/python tests/frameworks/clients/personaplex_client.py \
        --url http://127.0.0.1:8000 --api-key KEY
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from _common import RATE, Microphone, Report, StepFailed, run_report
from livekit import rtc
from livekit.agents import llm, utils
from livekit.plugins.nvidia.experimental.realtime import RealtimeModel

FRAMEWORK = "personaplex"
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
        }


class Client:
    """One RealtimeSession and what it emitted."""

    def __init__(self, model: RealtimeModel, report: Report, label: str) -> None:
        self.report = report
        self.label = label
        self.session = model.session()
        self.generations: list[Generation] = []
        self.errors: list[dict[str, Any]] = []
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
        frame = rtc.AudioFrame(
            data=pcm, sample_rate=RATE, num_channels=1, samples_per_channel=len(pcm) // 2
        )
        self.session.push_audio(frame)

    def latest(self) -> Generation | None:
        return self.generations[-1] if self.generations else None

    async def until(self, step: str, predicate: Any) -> Any:
        """Wait for `predicate()`, or fail `step` at once on an error event of the session."""
        result = await self.report.until(step, lambda: self.errors or predicate())
        if self.errors:
            raise StepFailed(step, f"error event: {self.errors[0]}")
        return result


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
        # (the plugin keeps it in a private event; nothing public tells)
        report.step("first", handshake=client.session._handshake_event.is_set(), **first.summary())

        # an interruption while a generation is active: checked and made in one turn of the
        # loop (the plugin also ends a generation after 500 ms without audio); the plugin ends
        # it (nothing goes to the server), and the model's next audio starts a new one
        def interrupt_active() -> Generation | None:
            generation = client.latest()
            if generation is None or not generation.active() or not generation.audio_samples:
                return None
            client.session.interrupt()
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
    finally:
        speaking.cancel()
        await mic.stop()
        await client.session.aclose()


def run() -> None:
    """Run the scenario and print what it saw as the last line of stdout."""
    run_report(Report(FRAMEWORK, parse_args()), main)


if __name__ == "__main__":
    run()
