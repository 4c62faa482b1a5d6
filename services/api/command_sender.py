"""`CommandSender`: one attachment's commands on their way to its worker's inbox.

The socket's reader does not wait for an append to be written: it hands the append to the
pod's ordered inbox writer (where it may linger for other sessions' appends to share its
entry) and reads the next frame, so a client that uploads faster than real time is not held
to one append per round. Every other command is awaited as before (a commit must not pass
an append, and the writer keeps their order anyway: one queue, rounds in order).

An append's failure reaches the client all the same, as the error event the reader would
have sent (`input_backpressure` for a full inbox, `internal_error` when Redis is away), with
the append's event_id, through `report`: by default onto the connection's live feed, as a
bare unsequenced event (the delivery pump sends it on, like an open's refusal); a
connection may instead hand it to its delivery directly.

Redis being away is told once per turn, not once per append: while appends keep failing
with `internal_error` (a failover takes seconds, and audio appends come every 20-100 ms),
the first is reported, the rest counted; a write that succeeds, or the next command that is
not an append (a commit, a response: the next turn), ends the run (the count is logged at
DEBUG: the pod's inbox writer logs the outage itself, once a run, with its length). A client
that sends nothing but appends (a native session's microphone: its turns are the model's to
find) has no next command to end a run: it is told again every `RETELL_S` while its appends
keep failing, so an utterance spoken later in a long outage is not lost untold. A full
inbox (`input_backpressure`) is still told for every append it drops: that is the client's
cue to slow down, and each is its own.

Backpressure stays: at most `MAX_UNSENT_APPENDS` appends (or `MAX_UNSENT_BYTES` of their
audio) of one attachment may be queued and unwritten; past that the reader waits for the
oldest to be written.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from services.api.inbox_writer import CommandSeq, InboxFull
from services.api.live import LiveFeed
from services.api.worker_client import WorkerClient
from shared.protocol.duplex import AppendAudio, DuplexCommand, DuplexErrorEvent

log = logging.getLogger(__name__)

#: a run of failing appends is told again after this long (a stream of appends alone)
RETELL_S = 2.0
MAX_UNSENT_APPENDS = 64
MAX_UNSENT_BYTES = 2 * 1024 * 1024
BACKPRESSURE = "the session's worker has too many unhandled commands; slow down and retry"
UNDELIVERED = "the command could not be delivered (the session store is unreachable); retry"

Report = Callable[[DuplexErrorEvent], None]


def failure_event(exc: BaseException, event_id: str | None) -> DuplexErrorEvent:
    """What the client hears when its command was not written."""
    if isinstance(exc, InboxFull):
        code, message = "input_backpressure", BACKPRESSURE
    else:
        code, message = "internal_error", UNDELIVERED
    return DuplexErrorEvent.for_code(code, message, related_event_id=event_id, retryable=True)


class CommandSender:
    def __init__(
        self,
        workers: WorkerClient,
        feed: LiveFeed | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._workers = workers
        self._clock = clock
        self.seqs = CommandSeq()  # handed out as each command's entry is built
        #: where an append's failure goes; None: logged only
        self.report: Report | None = None
        if feed is not None:
            self.report = lambda event: feed.push(event.to_json())
        self._unsent: collections.deque[tuple[asyncio.Future[None], int]] = collections.deque()
        self._unsent_bytes = 0
        #: the code of the failing run of appends already told, and how many more failed
        self._failing: str | None = None
        self._failed_since_told = 0
        self._told_at = 0.0  # when the run was last told (the clock's time)

    @property
    def unsent(self) -> int:
        return len(self._unsent)

    async def send(
        self, worker_id: str, session_id: str, attachment: int, command: DuplexCommand
    ) -> asyncio.Future[None] | None:
        """Queue the command. An append returns None once queued (its failure is reported);
        any other command returns its future, for the caller to await."""
        written = self._workers.send_command(worker_id, session_id, attachment, self.seqs, command)
        if not isinstance(command, AppendAudio):
            self._end_run(session_id)  # the next turn: its first failure is told again
            return written
        size = len(command.audio)
        self._unsent.append((written, size))
        self._unsent_bytes += size
        event_id = command.event_id
        if written.done():  # refused at once: the client hears it before the next frame
            self._settled(written, size, event_id, session_id)
        else:
            written.add_done_callback(
                lambda done: self._settled(done, size, event_id, session_id)
            )
        while self._unsent and (
            len(self._unsent) > MAX_UNSENT_APPENDS or self._unsent_bytes > MAX_UNSENT_BYTES
        ):
            oldest, _ = self._unsent[0]
            if oldest is written:
                break  # alone over the bound: it goes, the next one waits
            if oldest.done():  # written: its callback (which counts it out) runs next
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(Exception):  # its failure is reported by _settled
                await asyncio.shield(oldest)
        return None

    def _settled(
        self, done: asyncio.Future[None], size: int, event_id: str | None, session_id: str
    ) -> None:
        with contextlib.suppress(ValueError):
            self._unsent.remove((done, size))
            self._unsent_bytes -= size
        if done.cancelled():
            return
        if (exc := done.exception()) is None:
            self._end_run(session_id)  # written again
            return
        event = failure_event(exc, event_id)
        now = self._clock()
        if self._failing == event.code and now - self._told_at < RETELL_S:
            self._failed_since_told += 1  # told already, this turn
            return
        self._end_run(session_id)
        if event.code == "internal_error":
            self._failing = event.code
            self._told_at = now
        if not isinstance(exc, InboxFull | RedisError):
            log.error("an append of event %s was not written", event_id, exc_info=exc)
        elif isinstance(exc, RedisError):
            # the pod's inbox writer logs the outage once a run (`OutageLog`)
            log.debug(
                "session %s: an append (event %s) was not written: %s (told once; the "
                "appends after it that fail this turn are counted)",
                session_id,
                event_id,
                exc,
            )
        if self.report is not None:
            self.report(event)

    def _end_run(self, session_id: str) -> None:
        if self._failed_since_told:
            log.debug(
                "session %s: %d more appends were not written (%s), not told one by one",
                session_id,
                self._failed_since_told,
                self._failing,
            )
        self._failing, self._failed_since_told = None, 0
