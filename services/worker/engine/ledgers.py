"""Input and playback ledgers of one session."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class InputLedger:
    """The current user turn's audio (model input rate, float32) and its timing.

    `stream_ms` counts all input audio of the session, so VAD timestamps are
    session-relative like OpenAI's `audio_start_ms` / `audio_end_ms`.
    """

    sample_rate_hz: int
    chunks: list[np.ndarray] = dataclasses.field(default_factory=list)
    samples: int = 0
    stream_samples: int = 0
    text: str = ""
    speech_started_ms: int | None = None
    speech_stopped: bool = False
    item_id: str | None = None
    #: the inbox mark of the first append whose audio is in this turn (None: none yet).
    #: An ordinary checkpoint does not carry the turn's audio, so its `applied` mark
    #: stays before this append: a restore gets the turn's appends again, or reports
    #: them lost (`input_lost`), never drops them as applied.
    first_mark: tuple[int, int] | None = None

    @property
    def stream_ms(self) -> int:
        return self.stream_samples * 1000 // self.sample_rate_hz

    @property
    def buffered_bytes(self) -> int:
        return self.samples * 4

    @property
    def has_audio(self) -> bool:
        return self.samples > 0

    def append(self, audio: np.ndarray) -> None:
        if audio.size:
            self.chunks.append(audio)
            self.samples += audio.size
            self.stream_samples += audio.size

    def trim_before(self, stream_ms: int) -> None:
        """Drop buffered audio older than `stream_ms` (server VAD: leading silence)."""
        keep_from = stream_ms * self.sample_rate_hz // 1000
        drop = min(self.samples, max(0, keep_from - (self.stream_samples - self.samples)))
        if drop:
            audio = np.concatenate(self.chunks)[drop:]
            self.chunks = [audio] if audio.size else []
            self.samples = audio.size

    def peek(self) -> np.ndarray:
        """The turn's audio so far, leaving the ledger as it is."""
        if len(self.chunks) > 1:
            self.chunks = [np.concatenate(self.chunks)]
        return self.chunks[0] if self.chunks else np.zeros(0, np.float32)

    def take(self) -> np.ndarray:
        """The turn's audio; the ledger starts a new turn."""
        audio = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)
        self.clear()
        return audio

    def clear(self) -> None:
        self.chunks = []
        self.samples = 0
        self.text = ""
        self.speech_started_ms = None
        self.speech_stopped = False
        self.item_id = None
        self.first_mark = None


@dataclasses.dataclass
class PlaybackLedger:
    """What the client got and played of one response's audio, in ms.

    generated >= sent >= played; acknowledgements are monotonic (max);
    `committed_ms` is how much of the response belongs in history.
    """

    generated_ms: float = 0.0
    sent_ms: float = 0.0
    played_ms: float = 0.0
    committed_ms: float = 0.0

    def acknowledge(self, played_ms: float, committed_ms: float | None, truncate: bool) -> None:
        self.played_ms = min(max(self.played_ms, played_ms), self.sent_ms)
        if truncate:
            # the client stopped playback: history keeps exactly what was heard
            self.committed_ms = self.played_ms
        else:
            wanted = self.played_ms if committed_ms is None else committed_ms
            self.committed_ms = min(max(self.committed_ms, wanted), self.sent_ms)

    def to_dict(self) -> dict[str, float]:
        return {
            "generated_ms": self.generated_ms,
            "sent_ms": self.sent_ms,
            "played_ms": self.played_ms,
            "committed_ms": self.committed_ms,
        }
