"""Reconnect pacing for loops that talk to Redis: exponential, capped, jittered."""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass
class Backoff:
    initial_s: float = 0.1
    max_s: float = 2.0
    failures: int = 0

    def next_delay(self) -> float:
        """The pause before the next try; grows with each failure in a row."""
        delay = min(self.max_s, self.initial_s * (2**self.failures))
        self.failures += 1
        return delay * random.uniform(
            0.5, 1.0
        )  # jitter: pods that lost Redis together do not stampede

    def reset(self) -> None:
        self.failures = 0
