"""`SessionTable`: every session a worker holds, one `SessionRecord` each.

A worker keeps, per session, its runner, the owner generation it holds the session at, the
order its inbox commands apply in, what of its events is still to be published, and
whether it is moving to another worker. All of it is one record, in the shape of vLLM v1's
request-state table: the manager, the moves, the publisher, the drain and the ownership
checks are users of the record, none keeps a copy of any part of it, and removing a
session (`SessionTable.remove`) takes all of it at once.

A record's life (`Phase`):

    RESERVED --(runner built)--> LIVE --(close, hand-off, drop)--> LEAVING --(done)--> GONE
        \\--(open or restore refused)--> removed

- RESERVED: admitted, being built (an open or a restore awaiting its stage): holds a slot.
- LIVE: its runner serves it; commands reach it.
- LEAVING: closing, handed off or dropped: its runner is stopping; events it emits on the
  way out (the cancelled chain, session.closed) are still published.
- GONE: nothing more is emitted for it here. The record stays until its stage slot is
  cleaned up, its last events are in Redis and a drain's kept-back messages are sent on;
  then `settle` removes it.

A record without a phase of its own also carries the error refusing an open (UNOWNED): it
holds no slot and goes once that error is published.

Slots: a record holds one while RESERVED or LIVE, and after that until its stage cleanup
succeeded (a failed cleanup keeps the slot until the reaper's retry).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from services.worker.control.command_order import CommandOrder
from shared.contracts import DuplexSessionError, ModelHistory
from shared.redis.inbox_codec import InboxMessage
from shared.redis.store import ModelAppend, PublishItem, SessionWrite

#: The session's runner: the engine's `SessionRunner` (`SessionTable[SessionRunner]`). The
#: table holds it for the manager and the moves and never calls it, so the table stands
#: on the command order alone, not on the whole session engine under the runner.
Runner = TypeVar("Runner")


class Phase(enum.Enum):
    UNOWNED = "unowned"  # only an open's refusal to publish
    RESERVED = "reserved"
    LIVE = "live"
    LEAVING = "leaving"
    GONE = "gone"


@dataclasses.dataclass
class FinalCheckpoint:
    """A drain's final checkpoint, sent after the session's pending events."""

    data: bytes
    done: asyncio.Future[bool]


@dataclasses.dataclass(eq=False)
class PublishRound:
    """One session's part of a publisher batch: its events, the checkpoint and model history
    that go with them, and the token the call is sent under. A round whose call failed is
    sent again exactly as it was, under the same token (`Outbox.retry`): a call that had
    been written before its reply was lost (a connection dropped, a Redis failing over)
    is answered from Redis with the seqs it got, and nothing is journaled twice."""

    record: SessionRecord
    items: list[PublishItem]
    checkpoint: bytes | None
    final: FinalCheckpoint | None
    #: what of the session's model history to append, or None
    model: ModelAppend | None = None
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:16])

    def write(self, worker_id: str) -> SessionWrite:
        """This round as the store writes it: fenced on the record's owner generation."""
        record = self.record
        return SessionWrite(
            record.session_id,
            self.items,
            owner_generation=record.owner_generation or None,
            checkpoint=self.checkpoint or b"",
            stamp_seq=not record.unstamped,
            model_append=self.model,
            seq_floor=record.journaled_seq,
            worker_id=worker_id,
            round_token=self.token,
        )


@dataclasses.dataclass(eq=False)
class Outbox:
    """What of a session's events the publisher still has to send, and its checkpoints."""

    pending: list[PublishItem] = dataclasses.field(default_factory=list)
    #: events from here on are journaled (after session.created, or restored)
    journaled: bool = False
    #: a durable event is pending: the batch that takes it carries a fresh checkpoint
    dirty: bool = False
    #: a drain's final checkpoint, waiting for the session's pending events
    final: FinalCheckpoint | None = None
    #: the round of a batch that failed, sent again as it was before anything newer, not
    #: before `retry_at` (monotonic: its master's pause, on a cluster)
    retry: PublishRound | None = None
    retry_at: float = 0.0
    #: a batch of the session's events is on its way to Redis
    in_flight: bool = False
    #: handed off: its final checkpoint is still to come (`write_checkpoint`)
    awaiting_final: bool = False
    #: the model history's unwritten frames go with the next batch (about once a second)
    model_due: bool = False

    @property
    def idle(self) -> bool:
        return not (
            self.pending or self.final or self.in_flight or self.awaiting_final or self.retry
        )

    def discard(self) -> None:
        """Nothing more is sent (fenced out, dropped): a final still waiting is refused."""
        self.pending = []
        self.dirty = False
        retried = self.retry.final if self.retry is not None else None
        if retried is not None and not retried.done.done():
            retried.done.set_result(False)
        self.retry = None
        self.awaiting_final = False
        self.model_due = False
        if self.final is not None and not self.final.done.done():
            self.final.done.set_result(False)
        self.final = None


@dataclasses.dataclass(eq=False)
class SessionRecord(Generic[Runner]):
    session_id: str
    phase: Phase
    runner: Runner | None = None
    #: the owner generation this worker holds the session at (0: not owned here); every
    #: publish of the session is fenced on it
    owner_generation: int = 0
    #: its JSON goes without server_event_seq: a surface other than the duplex one (GA,
    #: Moshi's and GPT-Live's protocols have no such field)
    unstamped: bool = False
    #: the session's stage slot was cleaned up (or never taken)
    stage_clean: bool = False
    #: another worker owns the session: nothing is published for it any more
    fenced: bool = False
    #: the highest seq Redis has journaled for the session in this worker's calls: each
    #: call carries it, so a store that went back in time (a Redis failover lost writes)
    #: never hands out a seq a client may already have (event_publish.lua's seq floor)
    journaled_seq: int = 0
    order: CommandOrder = dataclasses.field(default_factory=CommandOrder)
    outbox: Outbox = dataclasses.field(default_factory=Outbox)
    #: a drain is moving the session: the inbox messages read for it meanwhile, held back
    #: until its new worker has its restore entry (None: not moving)
    kept_back: list[InboxMessage] | None = None
    #: the drain's task moving the session (or closing it: no worker can take it)
    drain_task: asyncio.Task[None] | None = None
    #: a model-native session's model history (what the publisher writes to Redis, what a
    #: move carries), from the moment it is served here; None: not a model-native session
    history: ModelHistory | None = None

    def serve(
        self,
        runner: Runner | None,
        *,
        history: ModelHistory | None,
        owner_generation: int,
        unstamped: bool,
        restored: bool = False,
    ) -> None:
        """RESERVED -> LIVE: the runner serves the session, held here at `owner_generation`;
        `history`: its model history (the runner's, a model-native session's; else None).
        `restored`: moved here from a checkpoint, so its events are journaled from the
        first (its session.created was published by the worker that opened it)."""
        self.runner = runner
        self.history = history
        self.owner_generation = owner_generation
        self.unstamped = unstamped
        self.fenced = False
        if restored:
            self.outbox.journaled = True
        self.phase = Phase.LIVE

    @property
    def holds_slot(self) -> bool:
        if self.phase is Phase.UNOWNED:
            return False
        return self.phase in (Phase.RESERVED, Phase.LIVE) or not self.stage_clean

    @property
    def owned(self) -> bool:
        """Held here: its errors and events are this worker's to publish."""
        return self.phase in (Phase.RESERVED, Phase.LIVE, Phase.LEAVING) and not self.fenced

    @property
    def settled(self) -> bool:
        """Nothing of it is left to do here: the record may go."""
        if self.phase is Phase.UNOWNED:
            return self.outbox.idle
        return (
            self.phase is Phase.GONE
            and self.stage_clean
            and (self.fenced or self.outbox.idle)
            and self.kept_back is None
        )


class SessionTable(Generic[Runner]):
    def __init__(self, max_sessions: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions = max_sessions
        self.clock = clock  # the command orders' hold windows
        self._records: dict[str, SessionRecord[Runner]] = {}
        #: chat completions in flight: each holds a slot while it runs (no session)
        self.chats = 0

    # ------------------------------------------------------------ lookups

    def get(self, session_id: str) -> SessionRecord[Runner] | None:
        return self._records.get(session_id)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._records

    def __iter__(self) -> Iterator[SessionRecord[Runner]]:
        return iter(list(self._records.values()))

    def live(self) -> list[SessionRecord[Runner]]:
        return [r for r in self._records.values() if r.phase is Phase.LIVE]

    def live_ids(self) -> list[str]:
        return [r.session_id for r in self._records.values() if r.phase is Phase.LIVE]

    def runner(self, session_id: str) -> Runner:
        """The session's runner; `DuplexSessionError` when it is not served here."""
        record = self._records.get(session_id)
        if record is None or record.phase in (Phase.UNOWNED, Phase.RESERVED):
            raise DuplexSessionError("unknown_session", f"no session {session_id}")
        if record.phase is not Phase.LIVE or record.runner is None:
            raise DuplexSessionError("session_closed", f"session {session_id} is closing")
        return record.runner

    def owner_generation(self, session_id: str) -> int | None:
        """The owner generation a live session is held at here (None: not held)."""
        record = self._records.get(session_id)
        if record is None or not record.owned or not record.owner_generation:
            return None
        return record.owner_generation

    # ------------------------------------------------------------ slots

    @property
    def slots_in_use(self) -> int:
        return sum(r.holds_slot for r in self._records.values()) + self.chats

    def check_room(self) -> None:
        if self.slots_in_use >= self.max_sessions:
            raise DuplexSessionError(
                "resource_exhausted",
                f"duplex_session_capacity_exhausted: limit={self.max_sessions}",
            )

    def reserve(self, session_id: str) -> SessionRecord[Runner]:
        """Admit a session (an open, a restore): a RESERVED record holding a slot. Refused
        when every slot is taken or the session is already here."""
        record = self._records.get(session_id)
        if record is not None and record.phase is not Phase.UNOWNED:
            raise DuplexSessionError("session_exists", f"session {session_id} already exists")
        self.check_room()
        if record is None:
            record = self._records[session_id] = SessionRecord(
                session_id, Phase.RESERVED, order=CommandOrder(clock=self.clock)
            )
        else:
            # an earlier refusal of the same id is still being published: the record goes
            # on carrying it (the publisher's queue holds this object), as a fresh session
            record.phase = Phase.RESERVED
            record.stage_clean = False
            record.fenced = False
            record.order = CommandOrder(clock=self.clock)
        return record

    def abort(self, record: SessionRecord[Runner]) -> None:
        """An open or a restore refused before its session was served: the reservation
        goes. What the record still has to publish (an earlier refusal) is sent first."""
        if self._records.get(record.session_id) is not record:
            return
        if record.outbox.idle:
            self.remove(record.session_id)
        else:
            record.phase = Phase.UNOWNED
            record.runner = None
            record.stage_clean = True

    def unowned(self, session_id: str) -> SessionRecord[Runner]:
        """The record that carries events of a session not held here (an open's refusal)."""
        record = self._records.get(session_id)
        if record is None:
            record = self._records[session_id] = SessionRecord(
                session_id, Phase.UNOWNED, stage_clean=True, order=CommandOrder(clock=self.clock)
            )
        return record

    # ------------------------------------------------------------ removal

    def settle(self, record: SessionRecord[Runner]) -> bool:
        """Remove the record if nothing of it is left to do; True when it went."""
        if record.settled and self._records.get(record.session_id) is record:
            self.remove(record.session_id)
            return True
        return False

    def remove(self, session_id: str) -> SessionRecord[Runner] | None:
        """Forget the session here, all of it: this is the only place a record goes."""
        record = self._records.pop(session_id, None)
        if record is not None:
            record.outbox.discard()
        return record

    # ------------------------------------------------------------ command order

    def next_hold_deadline(self) -> float | None:
        """When the oldest hold of any session's command order ends (None: none held)."""
        deadlines = [d for r in self._records.values() if (d := r.order.deadline()) is not None]
        return min(deadlines) if deadlines else None
