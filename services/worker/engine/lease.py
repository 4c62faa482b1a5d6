"""A session's idle lease on its worker: last activity and the idle TTL (contract section 5).

Only the idle half of the contract's lease lives here. Attachment, detach, disconnect
grace and the generation CAS of a resume are Redis's (`lease_detach.lua`,
`lease_resume.lua`, the janitor's `expire_leases`): the worker never sees a socket, so an
in-memory copy of them could only disagree with the truth.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

EXPIRED_IDLE_TTL = "idle_ttl_expired"


@dataclasses.dataclass
class LeaseState:
    """Idle TTL from the last activity; None disables it. `generation` is the contract's
    lease generation at open (0), bumped once when the session ends."""

    idle_ttl_s: float | None
    generation: int = 0
    clock: Callable[[], float] = time.monotonic
    last_activity: float = dataclasses.field(default=0.0)
    terminal: bool = False

    def __post_init__(self) -> None:
        self.last_activity = self.last_activity or self.clock()

    def touch(self, now: float | None = None) -> None:
        self.last_activity = self.clock() if now is None else now

    def mark_terminal(self) -> None:
        self.terminal = True
        self.generation += 1

    def expiry(self, now: float, *, busy: bool) -> str | None:
        """Why the lease has expired at `now`, or None: idle past the TTL while no
        operation is running."""
        if self.terminal or self.idle_ttl_s is None or busy:
            return None
        return EXPIRED_IDLE_TTL if now >= self.last_activity + self.idle_ttl_s else None
