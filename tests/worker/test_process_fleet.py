"""In-process worker processes on one real redis-server, and a session's live channel: the
fixture of the drain, restore and zombie tests (tests/worker/test_drain*.py,
tests/worker/test_process_*.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from services.worker.process import WorkerProcess
from shared.protocol.duplex import parse_client_event
from shared.redis.boundary import CommandRecord, ControlNotice, OpenRequest
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from shared.redis.live_message import split
from shared.redis.store import SessionStore
from shared.settings import WorkerSettings

TIMEOUT_S = 15


def note(item_id: str) -> dict[str, Any]:
    """conversation.item.create of a user text item (its id shows in the events)."""
    return {
        "type": "conversation.item.create",
        "item": {
            "id": item_id,
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": f"text of {item_id}"}],
        },
    }


async def until(check: Callable[[], Awaitable[Any]], timeout: float = TIMEOUT_S) -> Any:
    """Poll an observable (Redis, a worker's state) until it holds; its value."""
    async with asyncio.timeout(timeout):
        while not (value := await check()):
            await asyncio.sleep(0.01)
    return value


class Live:
    """What a session's live channel carried: its events, and its control notices."""

    def __init__(self, pubsub: Any) -> None:
        self.pubsub = pubsub
        self.events: list[dict[str, Any]] = []
        self.notices: list[ControlNotice] = []

    async def _read(self) -> None:
        message = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if message is None or message["type"] != "message":
            return
        data = message["data"]
        notice = ControlNotice.parse(data)
        if notice is not None:
            self.notices.append(notice)
        else:  # one live message: the session's events of one publisher round
            self.events += [orjson.loads(record.data) for record in split(data)]

    async def event(self, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first event (seen so far or coming) that `match`es."""
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                found = next((e for e in self.events if match(e)), None)
                if found is not None:
                    return found
                await self._read()

    async def of_type(self, wire_type: str, **fields: Any) -> dict[str, Any]:
        return await self.event(
            lambda e: e["type"] == wire_type and all(e.get(k) == v for k, v in fields.items())
        )

    async def notice(self) -> ControlNotice:
        async with asyncio.timeout(TIMEOUT_S):
            while not self.notices:
                await self._read()
        return self.notices[0]

    async def item_done(self, item_id: str) -> dict[str, Any]:
        """conversation.item.done of the item (the last event of a conversation.item.create)."""
        return await self.event(
            lambda e: e["type"] == "conversation.item.done" and e["item"]["id"] == item_id
        )

    def item_ids(self, event_type: str) -> list[str]:
        return [e["item"]["id"] for e in self.events if e["type"] == event_type]

    def seqs(self) -> list[int]:
        return [e["server_event_seq"] for e in self.events if "server_event_seq" in e]


class Fleet:
    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = f"moves-{uuid.uuid4().hex[:8]}"
        self.keys = KeySchema(self.prefix)
        self.handle = connect(url)
        self.client = self.handle.client
        self.store = SessionStore(self.client, self.keys)
        self.workers: dict[str, WorkerProcess] = {}
        self.stopped: set[str] = set()
        self.lives: list[Live] = []

    async def worker(self, worker_id: str, **settings: Any) -> WorkerProcess:
        values = {
            "max_sessions": 2,
            "heartbeat_interval_s": 0.05,
            "heartbeat_ttl_s": 5.0,
            "drain_timeout_s": 10.0,
            **settings,
        }
        worker = WorkerProcess(
            WorkerSettings(
                redis_url=self.url, key_prefix=self.prefix, worker_id=worker_id, **values
            ),
            self.handle,
        )
        await worker.start()
        self.workers[worker_id] = worker
        return worker

    async def stop(self, worker_id: str) -> None:
        self.stopped.add(worker_id)
        await self.workers[worker_id].stop()

    async def live(self, session_id: str) -> Live:
        pubsub = self.handle.new_client().pubsub()
        await pubsub.subscribe(self.keys.live(session_id))
        live = Live(pubsub)
        self.lives.append(live)
        return live

    async def open(self, worker_id: str, session_id: str) -> Live:
        """A session opened on the worker as an API pod opens one; waits for session.created."""
        await self.store.open(session_id, worker_id, "echo", "", "{}")
        live = await self.live(session_id)
        await self.store.inbox_append(worker_id, OpenRequest(session_id, {}).to_fields())
        await live.of_type("session.created")
        return live

    async def command(
        self, worker_id: str, session_id: str, attachment: int, seq: int, wire: dict[str, Any]
    ) -> None:
        """A client command into a worker's inbox, as an API pod writes it."""
        record = CommandRecord(session_id, attachment, seq, parse_client_event(wire))
        await self.store.inbox_append(worker_id, record.to_fields())

    async def meta(self, session_id: str) -> dict[str, str]:
        return await self.store.meta(session_id)

    async def close(self) -> None:
        for live in self.lives:
            await live.pubsub.aclose()
        for worker_id, worker in self.workers.items():
            if worker_id not in self.stopped:
                await worker.stop()
        await self.handle.close()
