"""Input parts for transcription and turn-detection tests: a scripted recogniser over the
echo model, and a way to feed audio that applies every result in a deterministic order."""

import threading

import numpy as np

from plugins.echo import EchoPlugin
from services.worker.engine.transcription import PartialTranscript
from tests.worker.session_parts import RATE


class Recogniser(EchoPlugin):
    """The echo model with a scripted recogniser: `partials` in order (the last repeats),
    `final` at the commit, or `fails` raised there. `gate`, when set, holds every partial
    decode until the test opens it."""

    def __init__(self, partials=(), final="final words", fails=None) -> None:
        self.partials = list(partials)
        self.final = final
        self.fails = fails
        self.decoded: list[int] = []  # samples of each partial decode
        self.gate: threading.Event | None = None

    def transcribe(self, audio, sample_rate_hz):
        if self.fails is not None:
            raise self.fails
        return self.final

    def transcribe_partial(self, audio, sample_rate_hz):
        if self.gate is not None:
            self.gate.wait(10)
        self.decoded.append(len(audio))
        index = min(len(self.decoded), len(self.partials)) - 1
        return self.partials[index] if self.partials else None


def loud(ms: int) -> np.ndarray:
    return np.full(RATE * ms // 1000, 0.3, np.float32)


def quiet(ms: int) -> np.ndarray:
    return np.zeros(RATE * ms // 1000, np.float32)


async def feed(parts, samples: np.ndarray, chunk_ms: int = 20) -> None:
    """Append `samples` 20 ms at a time, applying each result; a partial decode started by
    an append is waited for and applied before the next append (a deterministic order)."""
    step = RATE * chunk_ms // 1000
    for start in range(0, len(samples), step):
        parts.append(samples[start : start + step])
        await settle(parts)


async def settle(parts) -> None:
    """Apply what the mailbox holds until no input work or partial decode is left."""
    while not parts.input.queue.idle or parts.input.partials.in_flight or not parts.mailbox.empty():
        await parts.apply(await parts.next_ready())


def of(events, kind):
    return [e for e in events if e.wire_type == kind]


async def feed_without_waiting(parts, samples: np.ndarray) -> None:
    """Append and apply the append results, but leave a partial decode running."""
    step = RATE * 20 // 1000
    for start in range(0, len(samples), step):
        parts.append(samples[start : start + step])
        while True:
            item = await parts.next_ready()
            await parts.apply(item)
            if not isinstance(item, PartialTranscript):
                break


async def settle_input_only(parts) -> None:
    while not parts.input.queue.idle or not parts.mailbox.empty():
        await parts.apply(await parts.next_ready())
