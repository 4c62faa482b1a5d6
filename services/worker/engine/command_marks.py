"""`CommandMarks`: which inbox commands of one session have had their whole effect.

Every command from the inbox carries a mark, (attachment generation, seq), and marks reach
a session in increasing order. A command is *complete* once its effect is in the session's
state: a command handled inline when the runner has handled it; an append or a commit when
the input controller has applied its result (or dropped it: stale after an input.cancel,
refused); a command queued in input order (response.create, text, clear) when it has come
back through the input queue and run; a command refused at submit at once.

`applied` is the highest mark such that every mark up to it is complete: the mark a
checkpoint taken now is exact for (a restore drops every command at or below it and
applies every one after it). An append still converting keeps `applied` before it even
when later heartbeats have been handled.

Mark (0, 0) is "no mark" (the inline client, server-VAD commits): never tracked.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

Mark = tuple[int, int]
NO_MARK: Mark = (0, 0)


class CommandMarks:
    def __init__(self, applied: Mark = NO_MARK) -> None:
        self._applied = applied
        #: marks begun and not yet popped, oldest first, with whether each is complete
        self._in_flight: collections.deque[list] = collections.deque()
        self._index: dict[Mark, list] = {}

    @property
    def applied(self) -> Mark:
        return self._applied

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def begin(self, mark: Mark) -> None:
        """A command with this mark entered the session (it is not complete yet)."""
        if mark == NO_MARK or mark in self._index:
            return
        entry = [mark, False]
        self._in_flight.append(entry)
        self._index[mark] = entry

    def complete(self, mark: Mark) -> None:
        """The command's effect is in the session (or it had none)."""
        entry = self._index.get(mark)
        if entry is None:
            return
        entry[1] = True
        while self._in_flight and self._in_flight[0][1]:
            done = self._in_flight.popleft()
            del self._index[done[0]]
            self._applied = max(self._applied, done[0])

    @contextlib.contextmanager
    def completing(self, mark: Mark) -> Iterator[None]:
        """The command is complete once the work in the block ended, however it ended."""
        try:
            yield
        finally:
            self.complete(mark)

    def handled(self, mark: Mark) -> None:
        """A command complete as it arrived (refused at submit)."""
        self.begin(mark)
        self.complete(mark)


class CommandTicket:
    """One command on its way through a handler: what the manager reserved for it and its
    mark. A handler that hands the command to input work (`InputController.schedule_*`)
    takes the mark with it (`defer`): the command completes when that work is applied.
    Otherwise it completes when its handler returns."""

    __slots__ = ("deferred", "mark", "reserved")

    def __init__(self, reserved: int = 0, mark: Mark = NO_MARK) -> None:
        self.reserved = reserved
        self.mark = mark
        self.deferred = False

    def defer(self) -> Mark:
        """The mark, for the input work that completes the command later."""
        self.deferred = True
        return self.mark
