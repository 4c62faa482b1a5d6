"""Synthesized speech for the assistant: a phrase said by espeak-ng at 16 kHz, a client
that streams audio like a microphone (20 ms appends in real time), and how much of a phrase a
recogniser heard.

`spoken(text)` is the same audio every time, whatever was synthesized before it in the process
(plugins/assistant/tts.py reloads libespeak-ng for each synthesis); recognition of it still
varies with the recogniser's CPU kernels, so tests check words in common (`overlap`), with
thresholds under the worst measured, not exact transcripts."""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np

from plugins.assistant.tts import EspeakSynthesizer
from shared.client.duplex_client import DuplexClient
from shared.protocol.duplex import StreamingResampler, float_to_pcm16

# A session for the assistant through the whole server: 16 kHz pcm in, server VAD, real time.
ASSISTANT_SESSION = {
    "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}},
    "turn_detection": {"type": "server_vad"},
    "playback_commit_policy": "ack_only",
    "extra_body": {"pace": 1},
}


def spoken(text: str, lead_s: float = 0.4, tail_s: float = 1.0) -> np.ndarray:
    """`text` said by espeak-ng, at 16 kHz, between silences."""
    tts = EspeakSynthesizer.shared()
    resampler = StreamingResampler(tts.sample_rate_hz, 16000)
    speech = np.concatenate([resampler.process(tts.synthesize(text)), resampler.flush()])
    return np.concatenate(
        [
            np.zeros(int(lead_s * 16000), np.float32),
            speech,
            np.zeros(int(tail_s * 16000), np.float32),
        ]
    )


def overlap(heard: str, said: str) -> float:
    """The share of the words said that were heard: lower case, punctuation ignored, each
    heard word counted once ("the the" hears "the" twice only if it was said twice)."""
    heard_words = re.findall(r"[a-z0-9']+", heard.lower())
    said_words = re.findall(r"[a-z0-9']+", said.lower())
    found = 0
    for word in said_words:
        if word in heard_words:
            heard_words.remove(word)
            found += 1
    return found / len(said_words) if said_words else 0.0


async def say(client: DuplexClient, audio: np.ndarray) -> None:
    """Stream like a microphone: 20 ms appends in real time."""
    pcm = float_to_pcm16(audio)
    started = time.monotonic()
    for n, i in enumerate(range(0, len(pcm), 640)):
        await asyncio.sleep(max(0.0, started + n * 0.02 - time.monotonic()))
        await client.append_audio(pcm[i : i + 640])
