"""One round of the inbox writer: what is queued, grouped into one entry per inbox.

Each queued item is a message for a worker, routed to one of its inbox stripes (one on a
single Redis; one per master on a cluster, the session's: shared/redis/inbox_stripes.py).
A round takes items in queue order and gives each worker's stripe one entry: its messages
in that order
(`shared.redis.inbox_codec.encode_entry`). A command's seq is handed out here,
when its entry is built (`CommandSeq`), not when it was queued: should the inbox's budget
refuse the entry, its seqs are given back and the attachment's seqs stay contiguous (a gap
means commands lost in a move to the worker: `input_lost`).

A round stops early rather than give one attachment's commands two entries (a `moved`
notice between two of its commands), or a stripe a second entry, or an item whose stripe
is not known yet a place before the items after it: every command of an
attachment in a round is in one entry, so one refusal gives back a contiguous run of seqs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from shared.redis.boundary import CommandRecord, InboxMessage, encode_entry, entry_bytes

#: at most this much audio in one entry: the rest of a round waits for the next
MAX_ENTRY_BYTES = 4 * 1024 * 1024
MAX_ITEMS = 512  # items one round takes at most


class CommandSeq:
    """An attachment's command seqs: `last` is the last handed out (the API side's count
    of the commands it wrote; the worker drops a mark at or below what it applied)."""

    __slots__ = ("last",)

    def __init__(self, last: int = 0) -> None:
        self.last = last


@dataclasses.dataclass(eq=False)
class Queued:
    """One item of the writer's queue; `future` settles once it is written or refused."""

    worker_id: str
    budgeted: bool
    future: asyncio.Future[None]
    message: InboxMessage  # in one entry with the worker's other messages
    seqs: CommandSeq | None = None  # hands out the command's seq when its entry is built
    lingers: bool = False  # an append: may wait for others to share its entry
    #: the worker's inbox stripe its session's messages go to (None: not known yet)
    stripe: int | None = None
    #: when it was queued (monotonic): what a round cut short leaves behind has lingered
    #: since then, not since the round left
    queued_at: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return len(self.message.audio)


@dataclasses.dataclass(eq=False)
class Entry:
    """One entry for one worker's inbox stripe: the items it carries and its fields."""

    worker_id: str
    stripe: int
    items: list[Queued]
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def budgeted(self) -> bool:
        return any(item.budgeted for item in self.items)

    def args(self, max_bytes: int) -> list[Any]:
        """inbox_append.lua's ARGV: budget, cost, field, value, ..."""
        args: list[Any] = [max_bytes if self.budgeted else 0, entry_bytes(self.fields)]
        for name, value in self.fields.items():
            args += [name, value]
        return args

    def seal(self) -> Entry:
        """Hand out the seqs and build the fields."""
        messages: list[InboxMessage] = []
        for item in self.items:
            message = item.message
            if item.seqs is not None and isinstance(message, CommandRecord):
                item.seqs.last += 1
                message = message.with_seq(item.seqs.last)
            messages.append(message)
        self.fields = encode_entry(messages)
        return self

    def give_back_seqs(self) -> None:
        """The entry was refused (nothing written): its seqs are handed out again."""
        for item in reversed(self.items):
            if item.seqs is not None:
                item.seqs.last -= 1

    def unbudgeted(self) -> Entry | None:
        """What of a refused entry passes a full inbox, as an entry of its own."""
        items = [item for item in self.items if not item.budgeted]
        return Entry(self.worker_id, self.stripe, items).seal() if items else None


def take_round(queue: list[Queued]) -> tuple[list[Entry], list[Queued]]:
    """The entries of one round from the head of `queue`, and what is left for the next
    (from the first item whose stripe is not known yet, too: order is kept)."""
    entries: dict[tuple[str, int], Entry] = {}
    seq_worker: dict[int, str] = {}  # id(CommandSeq) -> the worker of its commands
    order: list[Entry] = []
    sizes: dict[tuple[str, int], int] = {}
    taken = 0
    for item in queue[:MAX_ITEMS]:
        worker = item.worker_id
        if item.stripe is None:
            break  # its worker's stripes are being read: it and what follows wait
        if item.seqs is not None and seq_worker.setdefault(id(item.seqs), worker) != worker:
            break  # an attachment moved between two commands: the rest go next round
        inbox = (worker, item.stripe)
        entry = entries.get(inbox)
        if entry is None:
            entry = entries[inbox] = Entry(worker, item.stripe, [])
            order.append(entry)
        elif sizes.get(inbox, 0) + item.size > MAX_ENTRY_BYTES:
            break
        entry.items.append(item)
        sizes[inbox] = sizes.get(inbox, 0) + item.size
        taken += 1
    return [entry.seal() for entry in order], queue[taken:]


def items_of(entries: Sequence[Entry]) -> list[Queued]:
    return [item for entry in entries for item in entry.items]
