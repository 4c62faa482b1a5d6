"""A SessionManager with the echo model, driven by the inline client; test audio (sine, speech)."""

from __future__ import annotations

import dataclasses
import wave
from pathlib import Path

import numpy as np

from plugins.echo import EchoPlugin
from services.worker.control.manager import SessionManager
from shared.client.inline import InlineDuplexClient, InlineEventRouter
from shared.contracts import SessionRuntimeConfig
from shared.protocol.duplex import AppendAudio, float_to_pcm16

DATA = Path(__file__).resolve().parent / "data"
FAST = {"extra_body": {"pace": 0}}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Harness:
    manager: SessionManager
    client: InlineDuplexClient
    router: InlineEventRouter
    clock: FakeClock

    async def open(self, session: dict | None = None):
        return await self.client.open(FAST if session is None else session)


def make_harness(plugin=None, port=None, **runtime) -> Harness:
    router = InlineEventRouter()
    clock = FakeClock()
    config = SessionRuntimeConfig(**{"max_sessions": 4, **runtime})
    manager = SessionManager(plugin or EchoPlugin(), config, router, port=port, clock=clock)
    return Harness(manager, InlineDuplexClient(manager, router), router, clock)


def sine(rate: int, seconds: float, hz: float = 440.0, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def appends(samples: np.ndarray, rate: int, chunk_ms: int = 20, **fields) -> list[AppendAudio]:
    """20 ms pcm16 appends of `samples`."""
    pcm = float_to_pcm16(samples)
    step = rate * chunk_ms // 1000 * 2
    return [
        AppendAudio(audio=pcm[i : i + step], format="pcm16", sample_rate_hz=rate, **fields)
        for i in range(0, len(pcm), step)
    ]


def speech_wav() -> tuple[np.ndarray, int]:
    """'Hello there, can you hear me?' spoken by espeak-ng (harness/data/README.md)."""
    with wave.open(str(DATA / "speech_16k.wav")) as wav:
        data = wav.readframes(wav.getnframes())
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768, wav.getframerate()


def types(events) -> list[str]:
    return [event.wire_type for event in events]


async def send_all(session, commands) -> None:
    for command in commands:
        await session.send(command)
