"""`CommandOrder`: which inbox commands of a session a worker applies, and when.

Every command entry carries the mark (attachment generation, seq) of the API connection that
sent it; one attachment's seqs are contiguous from 1 (a write the inbox refused consumes
none). Per session the worker keeps the last mark it applied:

- a mark at or below it is a redelivery (a restarted worker re-reading its pending entries,
  or a failover replaying what the checkpoint already holds): dropped;
- a session opened here applies every newer mark at once (today's rule: nothing of one
  connection overtakes anything in the one inbox stream it writes to);
- a session *restored* here (`restored(sid, mark)`, the checkpoint's `applied`) may get its
  commands from two streams at once: forwarded by its old worker, and written straight here
  by an API pod that has heard the move. A command of the same attachment past mark + 1 is
  held until the gap fills or the hold window (`HOLD_S`) ends; then the held commands are
  applied in order and each gap is reported once (`Released.lost`: the caller tells the
  client, `input_lost`). A command of a newer attachment (a resume) ends the old
  attachment's holds (released, gaps reported), and starts its own count from 0: its seq 1
  applies at once.

Pure and synchronous: the caller applies what `offer` and `expired` release, in the order
given, and drives expiry from `next_deadline` (the clock is injectable).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

Mark = tuple[int, int]
NO_MARK: Mark = (0, 0)
#: how long a restored session's command waits for the ones before it (forwarded by the
#: old worker, still on their way) before it is applied all the same
HOLD_S = 1.0


@dataclasses.dataclass(frozen=True)
class Released:
    """A command to apply now. `lost`: commands of its attachment that never came, just
    before it (report them to the client before applying this one)."""

    mark: Mark
    command: Any
    lost: int = 0


class CommandOrder:
    def __init__(self, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic):
        self.hold_s = hold_s
        self.clock = clock
        self._last: dict[str, Mark] = {}
        self._restored: set[str] = set()
        #: restored sessions' held commands: seq -> (command, when it arrived), all of the
        #: attachment of the session's last mark
        self._held: dict[str, dict[int, tuple[Any, float]]] = {}

    # ------------------------------------------------------------ state

    def last(self, session_id: str) -> Mark:
        """The last mark applied (or dropped as applied) for the session."""
        return self._last.get(session_id, NO_MARK)

    def held(self, session_id: str) -> int:
        return len(self._held.get(session_id, ()))

    def sessions(self) -> set[str]:
        return set(self._last) | set(self._held)

    def restored(self, session_id: str, mark: Mark) -> None:
        """The session was restored here from a checkpoint exact up to `mark`."""
        self._last[session_id] = tuple(mark)  # type: ignore[assignment]
        self._restored.add(session_id)
        self._held.pop(session_id, None)

    def forget(self, session_id: str) -> None:
        self._last.pop(session_id, None)
        self._restored.discard(session_id)
        self._held.pop(session_id, None)

    def retain(self, live: Iterable[str]) -> None:
        """Forget every session not in `live` (closed, expired, moved away, dropped)."""
        keep = set(live)
        for session_id in self.sessions() - keep:
            self.forget(session_id)

    # ------------------------------------------------------------ commands

    def offer(self, session_id: str, mark: Mark, command: Any) -> list[Released]:
        """A command read from the inbox: what to apply now, in order (maybe nothing)."""
        last = self.last(session_id)
        if mark <= last:
            return []
        if session_id not in self._restored:
            self._last[session_id] = mark
            return [Released(mark, command)]
        attachment, seq = mark
        released: list[Released] = []
        if attachment > last[0]:
            # a resume: what the old attachment still holds will not be completed now
            released = self._flush(session_id)
            last = self._last[session_id] = (attachment, 0)
        held = self._held.setdefault(session_id, {})
        if seq in held:
            return released  # a second copy of one already held
        if seq != last[1] + 1:
            held[seq] = (command, self.clock())
            return released
        self._last[session_id] = mark
        released.append(Released(mark, command))
        return released + self._release_run(session_id)

    def next_deadline(self) -> float | None:
        """When the oldest hold ends (None: nothing is held)."""
        starts = [min(t for _, t in held.values()) for held in self._held.values() if held]
        return min(starts) + self.hold_s if starts else None

    def release(self, session_id: str) -> list[Released]:
        """The session's held commands now, without waiting for their gaps (a move)."""
        return self._flush(session_id)

    def expired(self, now: float | None = None) -> list[tuple[str, list[Released]]]:
        """Sessions whose hold window has ended, with their held commands (gaps reported)."""
        now = self.clock() if now is None else now
        due = [
            session_id
            for session_id, held in self._held.items()
            if held and min(t for _, t in held.values()) + self.hold_s <= now
        ]
        return [(session_id, self._flush(session_id)) for session_id in due]

    # ------------------------------------------------------------ internals

    def _release_run(self, session_id: str) -> list[Released]:
        """The held commands that follow the last mark without a gap."""
        held = self._held.get(session_id, {})
        released = []
        attachment, seq = self._last[session_id]
        while (seq + 1) in held:
            seq += 1
            command, _ = held.pop(seq)
            released.append(Released((attachment, seq), command))
        self._last[session_id] = (attachment, seq)
        return released

    def _flush(self, session_id: str) -> list[Released]:
        """Every held command, in order, each gap before one counted once."""
        held = self._held.pop(session_id, {})
        if not held:
            return []
        attachment, last_seq = self._last[session_id]
        released = []
        for seq in sorted(held):
            released.append(Released((attachment, seq), held[seq][0], lost=seq - last_seq - 1))
            last_seq = seq
        self._last[session_id] = (attachment, last_seq)
        return released
