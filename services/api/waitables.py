"""`Flag` and `Mailbox`: asyncio's Event and unbounded Queue, without their idle cost.

An API pod holds a few of these per socket, and most sockets sit idle. asyncio.Event
allocates its waiter deque at construction and asyncio.Queue allocates four (items,
getters, putters and its `join` Event): an empty deque is a 760-byte block, so the
pod's and uvicorn's queues and events cost about 8 KiB per idle socket (bench/memory.py,
docs/benchmarks.md). These allocate only while something waits or is queued, and free
it again once nothing does.

Both are for one event loop, like asyncio's own.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _Ready:
    """What `Flag.wait` returns while the flag is set: done at once, nothing allocated."""

    __slots__ = ()

    def __await__(self) -> Generator[Any, None, bool]:
        return True
        yield  # a generator: `await` needs an iterator


READY = _Ready()


class Flag:
    """asyncio.Event's behaviour: `wait` returns at once while set, else at the next `set`.

    `wait` is a plain method returning the future to await (no coroutine frame per
    waiter): a waiter that is cancelled leaves its cancelled future in the list until the
    next `wait` or `set` sweeps it out."""

    __slots__ = ("_set", "_waiters")

    def __init__(self, value: bool = False) -> None:
        self._set = value
        self._waiters: list[asyncio.Future[bool]] | None = None  # only while someone waits

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(True)

    def clear(self) -> None:
        self._set = False

    def wait(self) -> Awaitable[bool]:
        if self._set:
            return READY
        waiter = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = [waiter]
        else:
            self._waiters = [w for w in self._waiters if not w.done()]
            self._waiters.append(waiter)
        return waiter


class Mailbox(Generic[T]):
    """A FIFO: `put_nowait` never blocks (no bound), `get` waits for an item.

    The item deque exists only while items are queued: an idle mailbox is two slots and
    an unset `Flag`."""

    __slots__ = ("_arrived", "_items")

    def __init__(self) -> None:
        self._items: collections.deque[T] | None = None
        self._arrived = Flag()  # set while items are queued

    def __len__(self) -> int:
        return len(self._items) if self._items is not None else 0

    def qsize(self) -> int:
        return len(self)

    def empty(self) -> bool:
        return self._items is None

    def put_nowait(self, item: T) -> None:
        if self._items is None:
            self._items = collections.deque()
        self._items.append(item)
        self._arrived.set()

    def get_nowait(self) -> T:
        """The oldest item; raises asyncio.QueueEmpty when there is none."""
        if self._items is None:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        if not self._items:
            self._items = None  # freed: an idle mailbox holds no deque
            self._arrived.clear()
        return item

    async def get(self) -> T:
        """The oldest item, once there is one. A cancelled `get` takes nothing: items are
        only taken by a `get` that returns."""
        while self._items is None:
            await self._arrived.wait()
        return self.get_nowait()
