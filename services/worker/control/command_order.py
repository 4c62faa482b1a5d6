"""`CommandOrder`: which inbox commands of one session a worker applies, and when.

Every command entry carries the mark (attachment generation, seq) of the API connection that
sent it; one attachment's seqs are contiguous from 1 (a write the inbox refused consumes
none). The session's record (`table.SessionRecord.order`) keeps the last mark applied:

- a mark at or below it is a redelivery (a restarted worker re-reading its pending entries,
  or a failover replaying what the checkpoint already holds): dropped;
- a session opened here applies every newer mark at once (nothing of one connection
  overtakes anything in the one inbox stream it writes to);
- a session *restored* here (`restored(mark)`, the checkpoint's `applied`) may get its
  commands from two streams at once: forwarded by its old worker, and written straight here
  by an API pod that has heard the move. A command of the same attachment past mark + 1 is
  held until the gap fills or the hold window (`HOLD_S`) ends; then the held commands are
  applied in order and each gap is reported once (`Released.lost`: the caller tells the
  client, `input_lost`). A command of a newer attachment (a resume) ends the old
  attachment's holds (released, gaps reported), and starts its own count from 0: its seq 1
  applies at once.

Pure and synchronous: the caller applies what `offer` and `expired` release, in the order
given, and drives expiry from `deadline` (the table's `next_hold_deadline` over every
session); the clock is injectable.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from services.worker.engine.command_marks import NO_MARK, Mark
from shared.protocol.duplex import DuplexCommand

#: how long a restored session's command waits for the ones before it (forwarded by the
#: old worker, still on their way) before it is applied all the same
HOLD_S = 1.0


@dataclasses.dataclass(frozen=True)
class Released:
    """A command to apply now. `lost`: commands of its attachment that never came, just
    before it (report them to the client before applying this one)."""

    mark: Mark
    command: DuplexCommand
    lost: int = 0


class CommandOrder:
    def __init__(self, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic):
        self.hold_s = hold_s
        self.clock = clock
        #: the last mark applied (or dropped as applied)
        self.last: Mark = NO_MARK
        self.is_restored = False
        #: held commands: seq -> (command, when it arrived), all of the attachment of `last`
        self._held: dict[int, tuple[DuplexCommand, float]] = {}

    @property
    def held(self) -> int:
        return len(self._held)

    def restored(self, mark: Mark) -> None:
        """The session was restored here from a checkpoint exact up to `mark`."""
        self.last = (mark[0], mark[1])
        self.is_restored = True
        self._held = {}

    # ------------------------------------------------------------ commands

    def offer(self, mark: Mark, command: DuplexCommand) -> list[Released]:
        """A command read from the inbox: what to apply now, in order (maybe nothing)."""
        if mark <= self.last:
            return []
        if not self.is_restored:
            self.last = mark
            return [Released(mark, command)]
        attachment, seq = mark
        released: list[Released] = []
        if attachment > self.last[0]:
            # a resume: what the old attachment still holds will not be completed now
            released = self.release()
            self.last = (attachment, 0)
        if seq in self._held:
            return released  # a second copy of one already held
        if seq != self.last[1] + 1:
            self._held[seq] = (command, self.clock())
            return released
        self.last = mark
        released.append(Released(mark, command))
        return released + self._release_run()

    def deadline(self) -> float | None:
        """When the oldest hold ends (None: nothing is held)."""
        if not self._held:
            return None
        return min(t for _, t in self._held.values()) + self.hold_s

    def expired(self, now: float | None = None) -> list[Released]:
        """The held commands when the hold window has ended (gaps reported), else none."""
        deadline = self.deadline()
        now = self.clock() if now is None else now
        if deadline is None or deadline > now:
            return []
        return self.release()

    def release(self) -> list[Released]:
        """Every held command now, in order, each gap before one counted once (a move, a
        resume, an expired hold)."""
        held, self._held = self._held, {}
        if not held:
            return []
        attachment, last_seq = self.last
        released = []
        for seq in sorted(held):
            released.append(Released((attachment, seq), held[seq][0], lost=seq - last_seq - 1))
            last_seq = seq
        self.last = (attachment, last_seq)
        return released

    def _release_run(self) -> list[Released]:
        """The held commands that follow the last mark without a gap."""
        released = []
        attachment, seq = self.last
        while (seq + 1) in self._held:
            seq += 1
            command, _ = self._held.pop(seq)
            released.append(Released((attachment, seq), command))
        self.last = (attachment, seq)
        return released
