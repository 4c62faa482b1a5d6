"""Events out to one client: the live pump, replay from the journal, gap fill, overflow.

Everything a socket sends goes through its `OutputQueue` (bounded, the seed's overflow
policy), and the worker's events reach it in `server_event_seq` order without a hole:

- a resume replays the journal from `last_received_server_event_seq + 1` before any live
  message is delivered (the feed was subscribed before the lease CAS, so nothing
  published since is lost: what the replay covered is skipped when it arrives live);
- a live message past a gap is preceded by the journal entries in between, or, when the
  journal no longer has them, by `session.resync_required` and nothing more;
- `CATCH_UP` (the hub reconnected) replays whatever the journal has past `last_seq`, and
  re-reads the session's owner from its hash (a `moved` notice may have been lost);
- a session whose hash is gone from Redis (a failover lost the writes that made it, or
  Redis restarted empty) can never journal an event again: told by its worker (`!lost`),
  or finding it so after `CATCH_UP`, the client hears `session.resync_required
  {journal_gap}` and nothing more, rather than waiting for ever;
- a `moved` notice (a drain or a failover put the session on another worker) routes the
  client's commands to the new worker, when its owner generation is newer;
- a client that reads too slowly overflows its queue: it hears `output_overflow`, and the
  worker is asked once to close the session;
- a live event under a seq the client already has is a duplicate (a replay and the live
  channel overlap) and is skipped, unless it is another event than the one delivered under
  that seq (`RECENT_SEQS` are remembered by checksum): the store went back in time, a Redis
  failover having lost the writes that journaled the client's last events, and the writer
  reuses their seqs. The client then hears `session.resync_required{journal_gap}` and
  nothing more, never a seq twice or one lower than it has.

A live message carries its events framed, each with a header (seq, type, response id)
ahead of the exact JSON the client gets (shared/redis/live_message.py): the pump splits
it and routes each event on its header, and the journal's records alike (split from its
entries as the pump splits a live message),
without parsing the JSON. Only the rare events whose content the pod needs are parsed:
session.created / .updated (the `SessionView`) and errors (their code, for the metrics,
and their event_id: the refusal of a session.update the connection waits on).

`SessionView` is the session object as the worker last confirmed it: the formats the
client's appends are parsed with and its idle timeout, which the connection reads. A
session.update changes them only once the worker accepted it (its session.updated); one
that would change the input format holds the client's next frames until the worker's
answer is delivered (`SessionView.expect` / `answer`): a refused one leaves them as they were.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import logging
import zlib
from typing import Any

import orjson

from services.api.attachment import Attachment, error
from services.api.live import LiveFeed
from services.api.metrics import ApiMetrics
from services.api.output_queue import OutItem, OutputQueue
from services.api.waitables import Flag
from shared.protocol.duplex import (
    AudioFormat,
    CommandContext,
    DuplexErrorEvent,
    DuplexEvent,
    InputAudioDefaults,
    RealtimeProtocolError,
    SessionReplaced,
    SessionResyncRequired,
)
from shared.redis.live_message import (
    CATCHUP_KIND,
    LOST_KIND,
    MOVED_KIND,
    TAKEOVER_KIND,
    ControlNotice,
    LiveMessageError,
    LiveRecord,
    decode_live,
)
from shared.redis.store import SessionStore

log = logging.getLogger(__name__)

#: the idle timeout of a socket until the session object says otherwise
DEFAULT_IDLE_TIMEOUT_S = 300.0
#: the types whose delivery means the session has ended (no release writes after them)
ENDINGS = frozenset({"session.closed", "session.expired"})
#: the types whose JSON the pod reads: the session object, an error's code
SESSION_TYPES = frozenset({"session.created", "session.updated"})


class PendingUpdate:
    """A session.update on its way to the worker that would change the input format."""

    __slots__ = ("answered", "before", "event_id")

    def __init__(self, before: AudioFormat, event_id: str | None) -> None:
        self.before = before  # the input format the worker last confirmed
        self.event_id = event_id  # the update's, which the worker's refusal carries
        self.answered = Flag()


class SessionView:
    """The session object as the worker last confirmed it, for parsing what the client sends.

    Its formats change only when the worker says so: a session.created, .updated or
    .resumed delivered to the client (`observe`). A session.update the client sends is not
    applied here: the worker may refuse it (`voice_update_after_audio_unsupported`, a
    model change, ...), and then the appends that follow it are still in the old format.

    An append without a format of its own crosses to the worker with the one resolved
    here, so an update that would change the input format is a barrier: the connection
    announces it (`expect`) and reads the client's next frame only once the worker has
    answered it (`answer`): its session.updated, or its refusal (an error with the
    update's event_id). Updates that leave the input format as it is are not waited for.
    """

    def __init__(self) -> None:
        self.idle_timeout_s = DEFAULT_IDLE_TIMEOUT_S
        self.defaults = InputAudioDefaults()  # sets self.context too
        self._pending: PendingUpdate | None = None  # only while a format change is in flight
        self._in_answer = False  # while `answer` waits

    @property
    def defaults(self) -> InputAudioDefaults:
        return self._defaults

    @defaults.setter
    def defaults(self, value: InputAudioDefaults) -> None:
        # one parse context per change, not per frame: appends arrive every 20 ms
        self._defaults = value
        self.context = CommandContext(value)

    def observe(self, session: Any) -> None:
        """A session object delivered (session.created, .updated, .resumed)."""
        if isinstance(session, dict):
            with contextlib.suppress(RealtimeProtocolError):
                self.defaults = InputAudioDefaults().updated(session)
            timeout = session.get("idle_timeout_s")
            if isinstance(timeout, int | float) and timeout > 0:
                self.idle_timeout_s = float(timeout)
        pending = self._pending
        if pending is not None and self.defaults.input_format != pending.before:
            # the update's session.updated: an earlier update's (or the open's) still
            # says the format in force before it
            self.settle()

    def expect(self, patch: dict[str, Any], event_id: str | None) -> bool:
        """A session.update is about to cross to the worker: True when, accepted, it would
        change the input format appends are parsed with (then `answer` waits for the
        worker's answer); False when it changes nothing the parse reads, or is invalid
        (the worker refuses it the same way, and nothing changes)."""
        try:
            proposed = self.defaults.updated(patch).input_format
        except RealtimeProtocolError:
            return False
        if proposed == self.defaults.input_format:
            return False
        self._pending = PendingUpdate(self.defaults.input_format, event_id)
        return True

    async def answer(self, timeout_s: float) -> bool:
        """Wait for the worker's answer to the update `expect` announced: True once it
        came (the formats are the worker's again), False after `timeout_s` without one
        (they stay what the worker last confirmed)."""
        pending = self._pending
        if pending is None:
            return True
        self._in_answer = True
        try:
            async with asyncio.timeout(timeout_s):
                await pending.answered.wait()
            return True
        except TimeoutError:
            return False
        finally:
            self._in_answer = False
            if self._pending is pending:
                self._pending = None

    @property
    def awaiting_answer(self) -> bool:
        """True while the connection waits in `answer` for the worker's answer to an update
        (the client's next frame is not read meanwhile); False before the wait began and from
        the moment the answer came or `settle` ran. It exists for the tests of that wait:
        they wait for it to be True, not a fixed sleep that hopes the reader got there, and
        see that an event which is not the answer leaves it True."""
        return self._in_answer and self._pending is not None

    def refused(self, event_id: str | None) -> None:
        """An error delivered: the refusal of the awaited update when it names the update's
        event_id (an update sent without one is answered by an error without one)."""
        pending = self._pending
        if pending is not None and event_id == pending.event_id:
            self.settle()

    def settle(self) -> None:
        """Stop waiting for an answer: it came, or will not (the update was not written,
        the session ended, the socket was taken over)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.answered.set()


#: how many delivered events' checksums a live duplicate is checked against: a replay and
#: the live channel overlap by a round or two; older duplicates are skipped unchecked
RECENT_SEQS = 512


class Delivery:
    def __init__(
        self,
        attachment: Attachment,
        feed: LiveFeed,
        queue: OutputQueue,
        store: SessionStore,
        metrics: ApiMetrics,
        view: SessionView,
    ) -> None:
        self.attachment = attachment
        self.feed = feed
        self.queue = queue
        self.store = store
        self.metrics = metrics
        self.view = view
        self.last_seq = 0  # the last server_event_seq queued for the client
        #: the last `RECENT_SEQS` delivered events: seq and CRC-32, at seq % RECENT_SEQS
        #: (two flat arrays, 6 KiB a session)
        self._recent_seqs = array.array("Q", bytes(8 * RECENT_SEQS))
        self._recent_crcs = array.array("I", bytes(4 * RECENT_SEQS))
        #: the close asked of the worker once the client overflowed its queue (awaitable)
        self.overflow_close: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ the writer's side

    async def get(self) -> OutItem:
        """The next item to send (the connection's writer is the only reader)."""
        return await self.queue.get()

    async def drained(self) -> None:
        """Return once the writer has taken everything queued."""
        await self.queue.drained()

    # ------------------------------------------------------------ the pod's own events

    def send(self, event: DuplexEvent) -> None:
        if isinstance(event, DuplexErrorEvent):
            self.metrics.errors.labels(event.code or "unknown").inc()
        self.queue.put(OutItem(event.to_json(), event.wire_type))

    def error(self, code: str, message: str, event_id: str | None = None, **extra: Any) -> None:
        self.send(error(code, message, event_id, **extra))

    def created(self, reply: dict[str, Any]) -> None:
        """The session.created of an open (from the worker's reply or the session hash)."""
        self.view.observe(reply.get("session"))
        self.queue.put(OutItem(orjson.dumps(reply), "session.created"))

    # ------------------------------------------------------------ the worker's events

    def enqueue(self, data: bytes, event: dict[str, Any]) -> None:
        """One event of the worker's, already parsed (the refusal of an open), for the client."""
        response_id = event.get("response_id")
        record = LiveRecord(
            0,
            str(event.get("type", "")),
            response_id if isinstance(response_id, str) else None,
            data,
        )
        self.deliver(record, event)

    def deliver(self, record: LiveRecord, event: dict[str, Any] | None = None) -> None:
        """One event of the worker's for the client, routed on its header: its JSON is
        queued as published, parsed only for a session object or an error code."""
        wire_type = record.wire_type
        if wire_type in SESSION_TYPES:
            event = event if event is not None else _parsed(record.data)
            self.view.observe(event.get("session"))
        if wire_type in ENDINGS:
            self.attachment.end()
            self.view.settle()  # an update still unanswered never will be
        elif wire_type == "error":  # the worker's errors count with the pod's own
            event = event if event is not None else _parsed(record.data)
            error = event.get("error")
            error = error if isinstance(error, dict) else {}
            self.metrics.errors.labels(error.get("code") or "unknown").inc()
            self.view.refused(error.get("event_id"))
        accepted = self.queue.put(OutItem(record.data, wire_type, record.response_id))
        self.metrics.events.inc()
        if not accepted and self.queue.overflowed and self.overflow_close is None:
            self.error("output_overflow", "the client reads too slowly; the session is closed")
            # one write, not a loop: a named task (enqueue runs inside the pump, which must
            # not wait on Redis for it), never restarted, its failure logged
            self.overflow_close = asyncio.get_running_loop().create_task(
                self.attachment.close("output_overflow"),
                name=f"overflow-close:{self.attachment.session_id}",
            )
            self.overflow_close.add_done_callback(_log_failure)

    async def resume_after(self, seq: int) -> bool:
        """A resumed session: the client has every event up to `seq`; queue the journal's
        after it. False when some are gone."""
        self.last_seq = seq
        # what the client got before is not known here
        self._recent_seqs = array.array("Q", bytes(8 * RECENT_SEQS))
        return await self.replay()

    async def replay(self, until_seq: int | None = None) -> bool:
        """Queue journal entries after `last_seq` (up to `until_seq`); False when some are gone."""
        records = await self.store.journal_records(
            self.attachment.session_id or "", self.last_seq, until_seq
        )
        for record in records:
            if record.seq != self.last_seq + 1:
                return False
            self._delivered_seq(record)
            self.deliver(record)
        return until_seq is None or self.last_seq >= until_seq

    async def pump(self) -> None:
        """Live messages to the client until a takeover or a journal gap ends it (a
        per-connection task: never restarted, cancelled when its socket goes)."""
        try:
            await self._pump()
        finally:  # taken over, resync, or the socket is gone: no answer will be delivered
            self.view.settle()

    async def _pump(self) -> None:
        attachment = self.attachment
        while True:
            data = await self.feed.get()
            try:
                message = decode_live(data)
            except (LiveMessageError, orjson.JSONDecodeError):
                log.error("session %s: a malformed live message, dropped", attachment.session_id)
                continue
            match message:
                case ControlNotice(kind=kind) as notice if kind == TAKEOVER_KIND:
                    if attachment.taken_over(notice.attachment_generation):
                        self.send(
                            SessionReplaced(
                                session_id=attachment.session_id,
                                attachment_generation=attachment.generation,
                            )
                        )
                        return
                    continue
                case ControlNotice(kind=kind) as notice if kind == MOVED_KIND:
                    # a drain or a failover moved the session
                    attachment.moved(notice.owner_generation, notice.worker_id)
                    continue
                case ControlNotice(kind=kind) if kind == CATCHUP_KIND:
                    # a `moved` or `lost` notice may have been lost with the connection:
                    # ask the hash
                    if await attachment.gone(unknown=False):
                        self._lost()
                        return
                    await attachment.reread_owner()
                    await self.replay()
                    continue
                case ControlNotice(kind=kind) if kind == LOST_KIND:
                    if not await attachment.gone(unknown=True):
                        continue  # the hash is there: a stale notice, not this session's end
                    self._lost()
                    return
                case ControlNotice():
                    continue  # a notice of a kind this pod does not know: not for it
                case records:
                    for record in records:
                        if not await self._route(record):
                            return

    async def _route(self, record: LiveRecord) -> bool:
        """One live event in seq order (a gap filled from the journal first); False when
        the gap cannot be filled: the client was told to resync, the pump ends."""
        if record.wire_type == "session.created":
            return True  # the open already delivered it (possibly from the session hash)
        seq = record.seq
        if seq:
            if seq <= self.last_seq:
                if self._is_another_event(record):
                    log.warning(
                        "session %s: seq %d came again with another event (the client has "
                        "up to %d): the session store went back in time, a Redis failover "
                        "lost its last writes; the client is told to resync",
                        self.attachment.session_id,
                        seq,
                        self.last_seq,
                    )
                    self.metrics.store_regressions.inc()
                    self._resync()
                    return False
                return True  # already replayed or delivered
            if seq > self.last_seq + 1 and not await self.replay(until_seq=seq - 1):
                self._resync()
                return False
            self._delivered_seq(record)
        self.deliver(record)
        return True

    def _lost(self) -> None:
        log.warning(
            "session %s: its hash is gone from Redis (a failover lost it, or Redis restarted "
            "empty); the client is told to resync",
            self.attachment.session_id,
        )
        self.metrics.sessions_lost.inc()
        self._resync()

    def _resync(self) -> None:
        session_id = self.attachment.session_id
        self.send(SessionResyncRequired(session_id=session_id, reason="journal_gap"))

    def _delivered_seq(self, record: LiveRecord) -> None:
        self.last_seq = record.seq
        slot = record.seq % RECENT_SEQS
        self._recent_seqs[slot] = record.seq
        self._recent_crcs[slot] = zlib.crc32(record.data)

    def _is_another_event(self, record: LiveRecord) -> bool:
        """A seq the client has, with other bytes than the event it got under it."""
        slot = record.seq % RECENT_SEQS
        return (
            self._recent_seqs[slot] == record.seq
            and self._recent_crcs[slot] != zlib.crc32(record.data)
        )


def _parsed(data: bytes) -> dict[str, Any]:
    """An event's JSON, for the few types whose content the pod reads."""
    with contextlib.suppress(orjson.JSONDecodeError):
        event = orjson.loads(data)
        if isinstance(event, dict):
            return event
    return {}


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("closing an overflowed session failed: %r", exc)


@dataclasses.dataclass(frozen=True)
class SessionParts:
    """What any surface's socket holds its session with (`ApiPod.session_parts`): its
    attachment (the hold), its delivery (the events out) and the session's view."""

    attachment: Attachment
    delivery: Delivery
    view: SessionView
