"""The tick-batched stage's clock: the time it reads and sleeps on, and its grid.

`TickClock`: what the tick reads the time from and sleeps on (monotonic seconds); the
tests and benchmarks pass one they drive themselves. `TickGrid`: when each step is due:
one every period (the model's frame, 80 ms for Mimi) on a fixed grid. The next step is due
one period after the previous due time; a step that ends past it is a deadline miss, and
the grid points it overran are skipped (no burst of steps to catch up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time


class TickClock:
    """Monotonic time and a sleep on it: the real ones."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def sleep_unless(self, seconds: float, event: asyncio.Event) -> bool:
        """Sleep `seconds`, or less if `event` is set meanwhile: True when it was."""
        if event.is_set():
            return True
        try:
            async with asyncio.timeout(seconds):
                await event.wait()
        except TimeoutError:
            return False
        return True


@dataclasses.dataclass(frozen=True)
class TickGrid:
    """The due times of the steps, `period_s` apart."""

    period_s: float

    def first_due(self, now: float) -> float:
        """The first step after an idle spell: one period on (a frame of input arrives first)."""
        return now + self.period_s

    def next_due(self, due: float, ended: float) -> tuple[float, bool]:
        """(the next step's due time, whether the step due at `due`, ended at `ended`, missed
        its deadline). One period on; past a miss, the next grid point after the step's end."""
        deadline = due + self.period_s
        if ended <= deadline:
            return deadline, False
        return due + self.period_s * math.ceil((ended - due) / self.period_s), True
