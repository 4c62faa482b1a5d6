"""Publishes a worker's session events to Redis: journal + live channel, batched, fenced.

`emit` (called by the session runners) only appends to a per-session buffer
and wakes the flusher; the flusher sends every buffered event of every session
in one pipelined round trip of `event_publish.lua` calls, one call per session.
Events of one session keep their order: the flusher is the only sender. The
flusher is a supervised loop: a failed batch is put back in front and retried by
the loop itself; anything else that escapes restarts it, with what it holds.

Per-session state lives in the session's record of the worker's `SessionTable`
(`services/worker/control/table.py`): its `Outbox` (pending events, whether they are
journaled, the dirty flag, a drain's final checkpoint, the checkpoint of a failed batch)
and its owner generation. The publisher keeps only the queue of records that have
something to send. A record whose session has gone settles (leaves the table) once its
last events are in Redis.

A session whose hash is gone (`[-1]`: a Redis failover lost the writes that made it, or
Redis restarted empty) can journal nothing ever again: it is dropped here like a fenced
one, and its sockets are told on its live channel (`!lost`), so that their clients hear
`session.resync_required` and start a new session instead of waiting for events.

Fencing: each session's calls carry the owner generation this worker holds it at (1 at
open, the restored one after a move). A `[-2]` reply means another worker owns the session
now: its remaining events are dropped, nothing more is sent for it, and the host's `drop`
(`PublishHost`: the manager's moves) forgets it locally.

Checkpoints: a durable event (`DURABLE`) marks its session dirty; when a batch is taken,
`host.snapshot(session_id)` (synchronous) is called for each dirty session of the batch and
its checkpoint goes in the same call as the events, so it matches the journal up to the
call's last event. `write_checkpoint` sends a drain's final checkpoint after the session's
pending events.

Model histories: a model-native session's model history (`ModelHistory`: its frames'
records) goes to Redis in the same fenced calls, append-only: every `MODEL_WRITE_S` the
sessions with unwritten frames are queued (`Outbox.model_due`), and a call carries the
bytes since the last write at their offset; a drain's final checkpoint and every
checkpoint snapshot take the rest with them, so a checkpoint never names frames the
history in Redis lacks. Never the whole history at each write.

A session's events of one round go out as one live message (event_publish.lua frames
them: shared/redis/live_message.py), each with its response's id in its header. An
openai-surface session publishes its JSON without `server_event_seq`: GA's events have no
such key; the seq still travels in the header.
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.worker.control.publish_host import FENCED_OUT, LOST, PublishHost
from services.worker.control.table import (
    FinalCheckpoint,
    Phase,
    PublishRound,
    SessionRecord,
    SessionTable,
)
from shared.backoff import Backoff
from shared.contracts import SessionEventSink
from shared.outage_log import OutageLog
from shared.protocol.duplex import DuplexEvent, dumps
from shared.redis.connection import publish_live
from shared.redis.live_message import ControlNotice
from shared.redis.store import (
    ModelAppend,
    PartialPublish,
    PublishItem,
    SessionStore,
)
from shared.supervised import SupervisedLoop

log = logging.getLogger(__name__)

# Not journaled: the first event (it carries the resume token on the wire, added
# by the API pod) and anything emitted before it (a refused open).
_UNJOURNALED = frozenset({"session.created"})
_CARRIES_SESSION = frozenset({"session.created", "session.updated"})
#: events whose response's id is the `id` of their `response` object, not a top-level key
_RESPONSE_OBJECT = frozenset({"response.created", "response.done"})
#: events after which the session's checkpoint is written (its state changed durably)
DURABLE = frozenset(
    {
        "session.created",
        "session.updated",
        "conversation.item.added",
        "conversation.item.created",
        "conversation.item.done",
        "conversation.item.deleted",
        "conversation.item.truncated",
        "conversation.item.input_audio_transcription.completed",
        "input_audio_buffer.committed",
        "response.created",
        "response.done",
        # GPT-Live's and Moshi's surfaces (native_surfaces.py): the surface state they
        # change (started, the mute flag, the usage reported) moves with the session
        "session.started",
        "session.input_audio.muted",
        "session.input_audio.unmuted",
        "session.usage.updated",
    }
)
FENCED, GONE = [-2], [-1]
#: how often a model-native session's new frames are written (its model history)
MODEL_WRITE_S = 1.0


def _response_id(event: DuplexEvent, wire_type: str) -> str | None:
    """The id of the response an event belongs to, for the live header: the API pod drops
    a cancelled response's queued audio by it (the openai surface's response events carry
    it only inside their `response` object)."""
    response_id = getattr(event, "response_id", None)
    if response_id is None and wire_type in _RESPONSE_OBJECT:
        response = getattr(event, "response", None)
        response_id = response.get("id") if isinstance(response, dict) else None
    return response_id if isinstance(response_id, str) else None


class RedisEventPublisher(SessionEventSink):
    def __init__(
        self,
        store: SessionStore,
        table: SessionTable,
        *,
        max_bytes: int,
        ttl_s: float,
        closed_ttl_s: float,
        sessions_key: str | None = None,
        worker_id: str = "",
    ) -> None:
        self.store = store
        self.table = table
        self.sessions_key = sessions_key  # the worker's set of sessions: closed ones leave it
        self.worker_id = worker_id  # named in each call: a lost move is set back to it
        self.max_bytes = max_bytes
        self.ttl_ms = int(ttl_s * 1000)
        self.closed_ttl_ms = int(closed_ttl_s * 1000)
        self.host: PublishHost | None = None
        #: the records with something to send, in the order they first had it (the record
        #: itself is the key: a session's record may be replaced while an older one's
        #: batch is out, and each must keep its own place)
        self._ready: dict[SessionRecord, None] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop: SupervisedLoop | None = None
        self._model_loop: SupervisedLoop | None = None
        self._backoff = Backoff()
        self._outage = OutageLog(log, "publishing sessions' events")
        self.published = 0
        self.checkpoints = 0
        self.model_bytes = 0  # model history bytes written
        self.lost = 0  # sessions dropped because their hash was gone from Redis

    def serve(self, host: PublishHost) -> None:
        """Whom to ask for checkpoints, and to tell of a session fenced out."""
        self.host = host

    # ------------------------------------------------------------ the sessions' side

    def emit(self, session_id: str, event: DuplexEvent) -> None:
        """An event of a session held here; one of a session not (or no longer) held here,
        or fenced out, is dropped."""
        record = self.table.get(session_id)
        if record is None or record.fenced:
            return
        self._queue(record, event)

    def emit_unowned(self, session_id: str, event: DuplexEvent) -> None:
        """An event for a session this worker does not hold (the error refusing an open):
        published unfenced and not journaled."""
        record = self.table.get(session_id) or self.table.unowned(session_id)
        if not record.fenced:
            self._queue(record, event)

    def _queue(self, record: SessionRecord, event: DuplexEvent) -> None:
        outbox = record.outbox
        wire_type = event.wire_type
        journaled = outbox.journaled and wire_type not in _UNJOURNALED
        if wire_type == "session.created":
            outbox.journaled = True
        session_json = dumps(event.session) if wire_type in _CARRIES_SESSION else b""  # type: ignore[attr-defined]
        outbox.pending.append(
            PublishItem(
                event.payload(), wire_type, journaled, session_json, _response_id(event, wire_type)
            )
        )
        if wire_type in DURABLE:
            outbox.dirty = True
        if wire_type == "session.closed":
            outbox.journaled = False
        self._ready[record] = None
        self._idle.clear()
        self._wake.set()

    async def write_checkpoint(self, session_id: str, data: bytes) -> bool:
        """Store a drain's final checkpoint, after every event of the session emitted so
        far, fenced like them. False: another worker owns the session (nothing written)."""
        record = self.table.get(session_id)
        if record is None or record.fenced:
            return False
        outbox = record.outbox
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if outbox.final is not None and not outbox.final.done.done():
            outbox.final.done.set_result(True)  # superseded: this one is written in its place
        outbox.final = FinalCheckpoint(data, done)
        outbox.awaiting_final = False
        outbox.dirty = False
        self._ready[record] = None
        self._idle.clear()
        self._wake.set()
        return await done

    # ------------------------------------------------------------ the flusher

    def start(self) -> None:
        self._loop = SupervisedLoop("event-publisher", self._run).start()
        self._model_loop = SupervisedLoop("model-history-writer", self._model_writes).start()

    async def _model_writes(self) -> None:
        """Every `MODEL_WRITE_S`: the sessions whose model history grew are queued."""
        while True:
            await asyncio.sleep(MODEL_WRITE_S)
            self.queue_model_writes()

    def queue_model_writes(self) -> None:
        """Queue every live session with unwritten model frames for the next batch."""
        if self.host is None:
            return
        for record in self.table.live():
            history = self.host.model_history(record.session_id)
            if history is not None and history.behind and not record.fenced:
                record.outbox.model_due = True
                self._ready[record] = None
                self._idle.clear()
                self._wake.set()

    def _take(self) -> list[PublishRound]:
        """The batch, and the checkpoints that go with it, taken at one instant."""
        ready, self._ready = self._ready, {}
        rounds = []
        now = time.monotonic()
        for record in ready:
            outbox = record.outbox
            if record.fenced or self.table.get(record.session_id) is not record:
                continue  # nothing is sent for it any more (fenced, or given up: removed)
            if outbox.retry is not None:
                if outbox.retry_at > now:
                    # its master is away: it waits its pause without holding the others
                    # (a wake is set for when it is due)
                    self._ready[record] = None
                    continue
                # a round that failed goes again as it was, under its token, before the
                # events emitted since (they follow in the next batch)
                rounds.append(outbox.retry)
                outbox.retry, outbox.in_flight = None, True
                continue
            if not outbox.pending and outbox.final is None and not outbox.model_due:
                continue
            items, outbox.pending = outbox.pending, []
            final, outbox.final = outbox.final, None
            checkpoint = None
            if final is not None:
                checkpoint = final.data
                outbox.dirty = False
            elif outbox.dirty:
                outbox.dirty = False
                checkpoint = self._snapshot(record.session_id)
            model = None
            if outbox.model_due or checkpoint is not None:
                outbox.model_due = False
                model = self._model_append(record.session_id)
            if not items and final is None and checkpoint is None and model is None:
                continue
            outbox.in_flight = True
            rounds.append(PublishRound(record, items, checkpoint, final, model))
        return rounds

    def _model_append(self, session_id: str) -> ModelAppend | None:
        if self.host is None:
            return None
        history = self.host.model_history(session_id)
        unwritten = history.unwritten() if history is not None else None
        if history is None or unwritten is None:
            return None
        return ModelAppend(unwritten[0], unwritten[1], history.meta_record_bytes)

    def _snapshot(self, session_id: str) -> bytes | None:
        if self.host is None:
            return None
        try:
            return self.host.snapshot(session_id)
        except Exception:
            log.exception("checkpoint of session %s failed; its events go without", session_id)
            return None

    async def _run(self) -> None:
        if self._ready:
            self._wake.set()  # restarted with events in hand: send them first
        while True:
            await self._wake.wait()
            self._wake.clear()
            rounds = self._take()
            try:
                await self._send(rounds)
            except asyncio.CancelledError:
                self._put_back(rounds)
                raise
            except PartialPublish as partial:
                # a cluster master is away: the rounds the others wrote are settled, only
                # the failed ones go back, each to wait its pause while the sessions on
                # the other masters go on at their own pace
                self._outage.failed(partial, traceback=False)
                done = [r for r in rounds if r.record.session_id in partial.written]
                await self._settle(done, partial.written)
                failed = [r for r in rounds if r.record.session_id not in partial.written]
                self._put_back(failed, self._backoff.next_delay())
                if not done:
                    await asyncio.sleep(self._backoff.next_delay())
                self._wake.set()
                continue
            except Exception as exc:
                # Redis is unreachable: put the batch back in front, retry after a pause
                # (logged once per outage: a failover fails every try for seconds)
                self._outage.failed(exc)
                self._put_back(rounds)
                await asyncio.sleep(self._backoff.next_delay())
                self._wake.set()
                continue
            self._backoff.reset()
            if not any(r.outbox.retry is not None for r in self._ready):
                self._outage.succeeded()  # not while a round still waits for its master
            now = time.monotonic()
            if any(r.outbox.retry is None or r.outbox.retry_at <= now for r in self._ready):
                self._wake.set()  # left for the next batch (the events after a retried round)
            elif not self._ready:
                self._idle.set()
            # else: only retries waiting their pause, whose timer wakes the loop

    def _put_back(self, rounds: list[PublishRound], pause_s: float = 0.0) -> None:
        """A batch that failed goes back in front: each round is sent again as it was, its
        checkpoint with it (still the one matching those events) and under its token, so a
        call that was written before its reply was lost is not journaled twice."""
        ready, self._ready = self._ready, {}
        for round_ in rounds:
            record, outbox = round_.record, round_.record.outbox
            outbox.in_flight = False
            if record.fenced or self.table.get(record.session_id) is not record:
                if round_.final is not None and not round_.final.done.done():
                    round_.final.done.set_result(False)
                continue
            outbox.retry = round_
            outbox.retry_at = time.monotonic() + pause_s
            self._ready[record] = None
        for record in ready:
            self._ready[record] = None
        if pause_s > 0:
            asyncio.get_running_loop().call_later(pause_s, self._wake.set)

    async def _send(self, rounds: list[PublishRound]) -> None:
        if not rounds:
            return
        replies = await self.store.publish_many(
            [round_.write(self.worker_id) for round_ in rounds],
            max_bytes=self.max_bytes,
            ttl_ms=self.ttl_ms,
            closed_ttl_ms=self.closed_ttl_ms,
        )
        await self._settle(rounds, replies)

    async def _settle(self, rounds: list[PublishRound], replies: dict[str, list[int]]) -> None:
        """The written rounds' replies taken in: seqs, fences, closed and lost sessions."""
        closed, lost = [], []
        for round_ in rounds:
            record = round_.record
            session_id = record.session_id
            record.outbox.in_flight = False
            reply = replies.get(session_id, [])
            if round_.final is not None and not round_.final.done.done():
                round_.final.done.set_result(reply not in (FENCED, GONE))
            if reply == FENCED:
                self._fenced_out(record, len(round_.items))
                continue
            if reply == GONE:
                # the session's hash is gone (closed and expired, or lost with a Redis that
                # restarted empty): nothing it sends is written, so nothing is sent again
                # (a model round would be re-queued at once, for ever); one still served
                # here is dropped, and its sockets are told
                if self._gone(record):
                    lost.append(session_id)
                continue
            self.published += len(round_.items)
            self.checkpoints += round_.checkpoint is not None
            journaled = max(reply[: len(round_.items)], default=0)
            record.journaled_seq = max(record.journaled_seq, journaled)
            if round_.model is not None and len(reply) == len(round_.items) + 1:
                self._model_written(record, round_.model, reply[-1])
            if round_.items and round_.items[-1].wire_type == "session.closed":
                closed.append(session_id)
            if record.outbox.pending or record.outbox.final or record.outbox.model_due:
                self._ready[record] = None  # emitted while this batch flew
        for round_ in rounds:
            self.table.settle(round_.record)
        await asyncio.gather(*(self._tell_lost(session_id) for session_id in lost))
        if closed and self.sessions_key:
            try:
                await self.store.client.srem(self.sessions_key, *closed)
            except Exception:
                # the batch is published: failing here must not send it again. A closed
                # session left in the set is skipped by every reader of it (its hash says
                # closed) and goes when the worker leaves
                log.warning("removing closed sessions from the worker's set failed", exc_info=True)

    def _model_written(self, record: SessionRecord, model: ModelAppend, length: int) -> None:
        """The history in Redis is `length` bytes long now. Shorter than what was sent
        (the key lost bytes: a gap the script refused to write past): the writer goes back
        to where Redis ends, and the next round writes the rest again from there."""
        history = self.host.model_history(record.session_id) if self.host is not None else None
        if history is None:
            return
        end = model.offset + len(model.data)
        if length >= end:
            history.mark_written(end)
            self.model_bytes += len(model.data)
            return
        log.warning(
            "session %s: its model history in Redis ends at %d bytes, not %d: written again "
            "from there",
            record.session_id,
            length,
            model.offset,
        )
        history.written = length
        record.outbox.model_due = True
        self._ready[record] = None
        self._idle.clear()
        self._wake.set()

    def _gone(self, record: SessionRecord) -> bool:
        """Nothing of the session is written, nor sent again (its model history is marked
        written). A session still served here (not fenced out, not closed) was lost by
        Redis: dropped here, like a fenced one; True then, and its sockets are to be told."""
        record.outbox.model_due = False
        if record.history is not None:
            record.history.mark_written(len(record.history.data))
        if record.fenced or record.phase not in (Phase.LIVE, Phase.LEAVING):
            # fenced out already, or not a session served here (an open's refusal, for an
            # open its API pod gave up on and removed)
            log.debug("session %s: its hash is gone from Redis: not written", record.session_id)
            return False
        log.warning(
            "session %s: its hash is gone from Redis (a failover lost it, or Redis restarted "
            "empty): dropped here, its clients are told to start a new session",
            record.session_id,
        )
        self.lost += 1
        self._drop(record, LOST)
        return True

    async def _tell_lost(self, session_id: str) -> None:
        """`!lost` on the session's live channel: its API pods end its sockets with
        `session.resync_required` (best effort: a pod that missed it finds the hash gone
        when its subscription comes back)."""
        channel = self.store.keys.live(session_id)
        try:
            await publish_live(self.store.client, channel, ControlNotice.lost().to_bytes())
        except Exception:
            log.warning("telling session %s's sockets it is lost failed", session_id)

    def _fenced_out(self, record: SessionRecord, refused: int) -> None:
        log.warning(
            "session %s: refused at owner generation %s (another worker owns it now); "
            "dropping it here with %d unsent events",
            record.session_id,
            record.owner_generation,
            refused + len(record.outbox.pending),
        )
        self._drop(record, FENCED_OUT)

    def _drop(self, record: SessionRecord, why: str) -> None:
        """Nothing more of the session is sent, and the host forgets it."""
        record.fenced = True
        record.outbox.discard()
        if self.host is not None and self.table.get(record.session_id) is record:
            # (a reply for a record replaced since, say by a restore here at a newer
            # generation, drops nothing: the session held now is not the one refused)
            try:
                self.host.drop(record.session_id, why)
            except Exception:
                log.exception("dropping session %s (%s) failed", record.session_id, why)

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything emitted so far is in Redis."""
        async with asyncio.timeout(timeout):
            await self._idle.wait()

    async def stop(self) -> None:
        if self._loop is not None:
            try:
                await self.flush()
            except TimeoutError:
                log.warning("stopping with unpublished events")
            await self._loop.stop()
        if self._model_loop is not None:
            await self._model_loop.stop()
