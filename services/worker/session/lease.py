"""A session's lease: generation CAS, disconnect grace, idle TTL (contract section 5)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

EXPIRED_DISCONNECT_GRACE = "disconnect_grace_expired"
EXPIRED_IDLE_TTL = "idle_ttl_expired"


class LeaseConflict(Exception):
    """A detach or resume carried a generation that is no longer current."""


@dataclasses.dataclass
class LeaseState:
    """Generation starts at 0; resume must name the current one and bumps it."""

    idle_ttl_s: float | None
    disconnect_grace_s: float
    generation: int = 0
    detached_at: float | None = None
    clock: Callable[[], float] = time.monotonic
    last_activity: float = dataclasses.field(default=0.0)
    terminal: bool = False

    def __post_init__(self) -> None:
        self.last_activity = self.last_activity or self.clock()

    def touch(self, now: float | None = None) -> None:
        self.last_activity = self.clock() if now is None else now

    def detach(self, expected_generation: int, now: float | None = None) -> None:
        """Fenced: a newer attachment is never detached by an older connection."""
        if self.terminal or expected_generation != self.generation:
            raise LeaseConflict(f"lease generation is {self.generation}, not {expected_generation}")
        now = self.clock() if now is None else now
        self.detached_at = now
        self.last_activity = now

    def resume(self, expected_generation: int, now: float | None = None) -> int:
        if self.terminal or expected_generation != self.generation:
            raise LeaseConflict(f"lease generation is {self.generation}, not {expected_generation}")
        self.generation += 1
        self.detached_at = None
        self.touch(now)
        return self.generation

    def mark_terminal(self) -> None:
        self.terminal = True
        self.generation += 1

    def expiry(self, now: float, *, busy: bool) -> str | None:
        """Why the lease has expired at `now`, or None."""
        if self.terminal:
            return None
        if self.detached_at is not None and now >= self.detached_at + self.disconnect_grace_s:
            return EXPIRED_DISCONNECT_GRACE
        if self.idle_ttl_s is not None and not busy and now >= self.last_activity + self.idle_ttl_s:
            return EXPIRED_IDLE_TTL
        return None
