"""LiveKit Agents' GPT-Live client as a client of duplex serve: `livekit-plugins-openai`'s
`realtime.GPTLiveModel` (its engine is `livekit.agents.llm._realtime.gpt_live`) and its
GPTLiveSession on OpenAI's GPT-Live protocol (`/v1/live/sessions`), without a LiveKit server:
configured as DuplexRealtimeAdapter configures it (`_update_session`), audio frames pushed to
it and read from its `audio_stream`, as AgentSession does with a room's tracks.

Against the echo frame model (it says each input frame back two frames later, with "." as its
text while it speaks), three tones tell the audio apart:

- `started`: session.start is answered by session.started;
- `update`: a session.update (what `update_options(tool_choice=...)` sends) by session.updated;
- `speak`: a tone comes back on `audio_stream`, and "transcript_delta" events with it;
- `mute`: `mute_input()` is acked (session.input_audio.muted), and a second tone said while
  muted never comes back;
- `unmute`: `unmute_input()` is acked (session.input_audio.unmuted), and a third tone comes back;
- `close`: `aclose()` sends session.close, and session.closed arrives before the socket closes
  (the client waits up to 5 s for it).

Every server event is also checked against the GPT-Live event models Pipecat ships (LiveKit
reads events without validating them): `live_problems`.

    .venv-frameworks/bin/python tests/frameworks/clients/gpt_live_client.py \
        --url http://127.0.0.1:8000 --api-key KEY --model frame_echo
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from _common import RATE, Microphone, Report, StepFailed, run_report, silence
from pipecat.services.openai.live import events as live_events

if TYPE_CHECKING:  # imported where used: pipecat_live_client.py shares this module's helpers
    from livekit.agents import llm

FRAMEWORK = "gpt_live"
#: the tones of the scenario's three phases (Hz): far apart, so that each frame that comes
#: back says which phase it echoes
TONES = {"speak": 400, "muted": 1000, "unmuted": 700}
#: a frame whose peak is over this (pcm16) is the tone coming back, not silence
LOUD = 2000
TONE_AMPLITUDE = 0.3
#: Pipecat's parser of GPT-Live server events, as imported (pipecat_live_client.py wraps the
#: module's name to record what the service reads)
PARSE_LIVE_EVENT = live_events.parse_server_event


def parse_args(
    description: str = "LiveKit GPTLiveModel against duplex serve", scenario: str = "gpt_live"
) -> argparse.Namespace:
    """The arguments of a GPT-Live client program (this one and pipecat_live_client's)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", required=True, help="http://HOST:PORT of duplex serve")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True, help="the served model's name")
    parser.add_argument("--step-timeout", type=float, default=30.0)
    args = parser.parse_args()
    args.scenario = scenario
    return args


def tone(frequency: float, seconds: float) -> bytes:
    t = np.arange(int(seconds * RATE)) / RATE
    samples = TONE_AMPLITUDE * np.sin(2 * np.pi * frequency * t)
    return (samples * 32767).astype("<i2").tobytes()


def which_tone(samples: np.ndarray) -> str | None:
    """The phase whose tone a loud frame carries (its spectrum's peak), or "other"."""
    if samples.size < 64 or int(np.abs(samples).max()) < LOUD:
        return None
    spectrum = np.abs(np.fft.rfft(samples.astype(np.float64) * np.hanning(samples.size)))
    peak = float(np.fft.rfftfreq(samples.size, 1 / RATE)[int(spectrum.argmax())])
    name, frequency = min(TONES.items(), key=lambda item: abs(item[1] - peak))
    return name if abs(frequency - peak) < 100 else "other"


class LiveReport(Report):
    """The common report, plus what GPT-Live adds: the Live schema problems and the frames."""

    def __init__(self, framework: str, args: argparse.Namespace) -> None:
        super().__init__(framework, args)
        #: the first problem of each server event type with Pipecat's GPT-Live models
        self.live_problems: dict[str, str] = {}
        self.heard: Counter[str] = Counter()
        self.audio_frames = 0
        self.audio_samples = 0
        self.transcript: list[dict[str, Any]] = []
        self.last_events: dict[str, dict[str, Any]] = {}

    def live_event(self, event: dict[str, Any]) -> None:
        kind = str(event.get("type"))
        self.server_events[kind] += 1
        if not kind.endswith(".delta") and len(self.trace) < 400:
            self.trace.append(kind)
        if kind != "session.output_audio.delta":
            self.last_events[kind] = event
        if kind not in self.live_problems:
            try:
                PARSE_LIVE_EVENT(json.dumps(event))
            except ValueError as error:
                self.live_problems[kind] = str(error)[:400]
        if kind == "error":
            self.errors.append(json.dumps(event.get("error"))[:500])
        self.notify()

    def result(self) -> dict[str, Any]:
        return {
            **super().result(),
            "live_problems": self.live_problems,
            "heard": dict(self.heard),
            "audio_frames": self.audio_frames,
            "audio_samples": self.audio_samples,
            "transcript": self.transcript[:50],
        }


class Client:
    def __init__(self, session: Any, report: LiveReport) -> None:
        self.session = session
        self.report = report
        session.on("openai_server_event_received", report.live_event)
        session.on("openai_client_event_queued", self._client_event)
        session.on("transcript_delta", self._transcript)
        session.on("error", self._error)
        self.reader = asyncio.get_running_loop().create_task(self._read_audio())

    def _client_event(self, event: dict[str, Any]) -> None:
        self.report.client_event(str(event.get("type")))

    def _transcript(self, event: llm.DuplexOutputTranscriptDelta) -> None:
        self.report.transcript.append(
            {"text": event.text, "start_ms": event.start_ms, "end_ms": event.end_ms}
        )
        self.report.notify()

    def _error(self, event: llm.RealtimeModelError) -> None:
        self.report.errors.append(f"framework error event: {event.error!r}"[:500])
        self.report.notify()

    async def _read_audio(self) -> None:
        async for frame in self.session.audio_stream:
            samples = np.frombuffer(frame.frame.data, dtype=np.int16)
            self.report.audio_frames += 1
            self.report.audio_samples += frame.frame.samples_per_channel
            if (name := which_tone(samples)) is not None:
                self.report.heard[name] += 1
            self.report.notify()

    def push(self, pcm: bytes) -> None:
        from livekit import rtc

        self.session.push_audio(
            rtc.AudioFrame(
                data=pcm, sample_rate=RATE, num_channels=1, samples_per_channel=len(pcm) // 2
            )
        )

    async def until(self, step: str, predicate: Any) -> Any:
        """Wait for `predicate()`, or fail `step` at once on an error."""
        result = await self.report.until(step, lambda: self.report.errors or predicate())
        if self.report.errors:
            raise StepFailed(step, f"error: {self.report.errors[0]}")
        return result


def check(step: str, condition: bool, why: str) -> None:
    if not condition:
        raise StepFailed(step, why)


async def main(args: argparse.Namespace, report: LiveReport) -> None:
    from livekit.plugins.openai.realtime import GPTLiveModel

    model = GPTLiveModel(model=args.model, api_key=args.api_key, base_url=f"{args.url}/v1")
    session = model.session()
    client = Client(session, report)
    events = report.server_events
    mic = Microphone(client.push, idle_silence=True).start()
    closed = False
    try:
        # what DuplexRealtimeAdapter does first: the whole configuration, which releases the
        # session.start (GPT-Live's instructions are immutable once it is sent)
        await session._update_session(instructions="You are a helpful assistant.")
        await client.until("started", lambda: events["session.started"])
        report.step("started", session_id=session.session_id)

        # what AgentSession's update_options(tool_choice=...) sends: a sparse session.update
        session._update_options(tool_choice="auto")
        await client.until("update", lambda: events["session.updated"])
        report.step("update", acked=True)

        await mic.say(tone(TONES["speak"], 2.0))
        await client.until("speak", lambda: report.heard["speak"] and report.transcript)
        report.step(
            "speak",
            heard=report.heard["speak"],
            transcript="".join(d["text"] for d in report.transcript),
        )

        session.mute_input()
        await client.until("mute", lambda: events["session.input_audio.muted"])
        await mic.say(tone(TONES["muted"], 1.0))
        # silence after it pushes the muted tone's last samples out of the plugin's 100 ms
        # chunker before the unmute is queued (they would go out after it, audible)
        await mic.say(silence(0.3))
        report.step("mute", acked=True)

        session.unmute_input()
        await client.until("unmute", lambda: events["session.input_audio.unmuted"])
        await mic.say(tone(TONES["unmuted"], 1.0))
        # the echo keeps the order of what it hears: once the third tone is back, anything of
        # the muted one would have come back before it
        await client.until("unmute", lambda: report.heard["unmuted"])
        report.step("unmute", acked=True, heard=report.heard["unmuted"])
        report.step("mute", acked=True, heard_while_muted=report.heard["muted"])
        check("mute", not report.heard["muted"], "the tone said while muted came back")

        await mic.stop()
        closed = True
        await session.aclose()
        await client.reader
        closing = report.last_events.get("session.closed")
        report.step(
            "close",
            session_closed=bool(closing),
            reason=(closing or {}).get("reason"),
            usage=(closing or {}).get("usage"),
        )
        check("close", bool(closing), "no session.closed before the socket closed")
    finally:
        await mic.stop()
        if not closed:
            await session.aclose()
        await model.aclose()


def run_scenario(
    framework: str,
    args: argparse.Namespace,
    main: Callable[[argparse.Namespace, LiveReport], Awaitable[None]],
) -> None:
    """Run `main(args, report)` and print the report as the last line of stdout."""
    run_report(LiveReport(framework, args), main)


if __name__ == "__main__":
    run_scenario(FRAMEWORK, parse_args(), main)
