"""The API pod's real parts on one fakeredis server, for the unit tests of services/api.

Nothing is faked but the worker: `ScriptedWorkers` is the real `WorkerClient` (it writes
the real inbox entries) whose open also answers the way a worker would, on the
attachment's live feed, once the entry is in the inbox.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import fakeredis
import orjson

from services.api.attachment import Attachment
from services.api.connection import RealtimeConnection
from services.api.delivery import Delivery, SessionView
from services.api.inbox_writer import InboxFull, InboxWriter
from services.api.live import LiveFeed, LiveHub
from services.api.liveness import PodLiveness
from services.api.metrics import ApiMetrics
from services.api.output_queue import OutputQueue
from services.api.worker_client import WorkerClient
from shared.protocol.duplex import SessionResume
from shared.redis.boundary import InboxMessage, decode_entry
from shared.redis.keys import KeySchema
from shared.redis.placement import WorkerDirectory
from shared.redis.store import PublishItem, SessionStore, token_digest

KEYS = KeySchema()
POD = "api-t"
JOURNAL = {"max_bytes": 1 << 20, "ttl_ms": 60_000, "closed_ttl_ms": 60_000}

#: (worker id, session id, the open's session object) -> the worker's reply, or None
Answer = Callable[[str, str, dict[str, Any]], dict[str, Any] | None]


def created(session_id: str, model: str = "echo") -> dict[str, Any]:
    return {"type": "session.created", "session": {"id": session_id, "model": model}}


class ScriptedWorkers(WorkerClient):
    """A WorkerClient whose opens are answered by `answer` (None: the worker is silent)."""

    def __init__(self, inbox: InboxWriter, answer: Answer | None = None) -> None:
        super().__init__(inbox)
        self.answer: Answer = answer or (lambda worker, sid, session: created(sid))
        self.feed: LiveFeed | None = None
        self.opens: list[str] = []  # the workers asked, in order

    async def open(self, worker_id: str, session_id: str, session: dict[str, Any]) -> None:
        await super().open(worker_id, session_id, session)
        self.opens.append(worker_id)
        reply = self.answer(worker_id, session_id, session)
        if reply is not None and self.feed is not None:
            self.feed.push(orjson.dumps(reply))


class RecordingInbox(InboxWriter):
    """An inbox that records what it is given (worker, message, budgeted) and writes
    nothing; `refuse` makes it refuse budgeted entries, as a full inbox does."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__(client=None)
        self.refuse = refuse
        self.appended: list[tuple[str, InboxMessage, bool]] = []

    async def append(self, worker_id: str, fields: dict[str, Any], *, budgeted: bool = True):
        if self.refuse and budgeted:
            raise InboxFull("over budget")
        self.appended.append((worker_id, fields, budgeted))

    def send(self, worker_id, message, *, budgeted=True, seqs=None, lingers=False):
        """What `WorkerClient` hands the writer: settled at once (a refusal takes no seq)."""
        future = asyncio.get_running_loop().create_future()
        if self.refuse and budgeted:
            future.set_exception(InboxFull("over budget"))
            return future
        if seqs is not None:
            seqs.last += 1
            message = message.with_seq(seqs.last)
        self.appended.append((worker_id, message, budgeted))
        future.set_result(None)
        return future

    async def stop(self) -> None:
        pass


@dataclasses.dataclass
class Parts:
    client: Any
    store: SessionStore
    hub: LiveHub
    directory: WorkerDirectory
    inbox: InboxWriter
    workers: WorkerClient
    liveness: PodLiveness
    metrics: ApiMetrics

    def attachment(
        self, feed: LiveFeed, *, open_timeout_s: float = 30.0, key_sha: str = ""
    ) -> Attachment:
        if isinstance(self.workers, ScriptedWorkers):
            self.workers.feed = feed
        return Attachment(
            feed=feed,
            hub=self.hub,
            store=self.store,
            client=self.client,
            keys=KEYS,
            directory=self.directory,
            workers=self.workers,
            liveness=self.liveness,
            pod_id=POD,
            open_timeout_s=open_timeout_s,
            disconnect_grace_s=30.0,
            key_sha=key_sha,
        )

    def delivery(
        self, attachment: Attachment, feed: LiveFeed, *, max_events: int = 512
    ) -> Delivery:
        queue = OutputQueue(2 << 20, max_events, 64 << 10, 8)
        return Delivery(attachment, feed, queue, self.store, self.metrics, SessionView())

    async def close(self) -> None:
        await self.inbox.stop()
        await self.hub.stop()
        await self.client.aclose()


def make_parts(
    answer: Answer | None = None, inbox: InboxWriter | None = None, client: Any = None
) -> Parts:
    client = client or fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    store = SessionStore(client, KEYS)
    inbox = inbox or InboxWriter(client, KEYS, store.scripts)
    return Parts(
        client=client,
        store=store,
        hub=LiveHub(client, KEYS.api(POD)),
        directory=WorkerDirectory(client, KEYS, heartbeat_ttl_s=5.0),
        inbox=inbox,
        workers=ScriptedWorkers(inbox, answer),
        liveness=PodLiveness(client, KEYS, store, POD, interval_s=60, ttl_s=600),
        metrics=ApiMetrics(),
    )


async def register_worker(
    client: Any,
    worker_id: str,
    *,
    model: str = "echo",
    resumable: bool = True,
    max_sessions: int = 4,
    active: int = 0,
    native: bool = False,
    beat_age_s: float = 0.0,
) -> None:
    """A worker as placement sees it: its hash, and a heartbeat `beat_age_s` old. `native`:
    a native (frame-clocked) model's, which Moshi's and GPT-Live's surfaces go to."""
    capabilities = {"supports_session_resume": resumable}
    if native:
        capabilities["supports_model_native_turn_policy"] = True
    await client.hset(
        KEYS.worker(worker_id),
        mapping={
            "model": model,
            "max_sessions": max_sessions,
            "active": active,
            "capabilities": orjson.dumps(capabilities),
        },
    )
    # a live worker (age 0) beats "an hour from now": it stays live however slowly a
    # loaded machine runs the test (a real beat every second is what keeps it so)
    age = beat_age_s if beat_age_s else -3600.0
    await client.zadd(KEYS.workers(), {worker_id: int((time.time() - age) * 1000)})


async def active_session(
    store: SessionStore, sid: str, worker: str = "worker-a", token: str = "tok"
) -> None:
    """A session its worker admitted (state active), resumable with `token`."""
    await store.open(sid, worker, "echo", token_digest(token), "{}", POD)
    session = orjson.dumps({"id": sid, "model": "echo"})
    item = PublishItem(orjson.dumps(created(sid)), "session.created", False, session)
    await store.publish(sid, [item], **JOURNAL)


async def resumed_connection(
    parts: Any, sid: str, *, max_input_bytes: int = 1 << 20
) -> tuple[RealtimeConnection, dict[str, Any]]:
    """A connection whose attachment resumed `sid` (an active session on worker-a, made
    here), and the session object the resume returned; its delivery pump is not started."""
    await active_session(parts.store, sid)
    feed = LiveFeed()
    attachment = parts.attachment(feed)
    resumed = await attachment.resume(SessionResume(session_id=sid, resume_token="tok"))
    delivery = parts.delivery(attachment, feed)
    connection = RealtimeConnection(
        None,
        attachment,
        delivery,
        delivery.view,
        parts.metrics,
        model=None,
        autostart=True,
        resume_only=False,
        config_timeout_s=10.0,
        max_input_bytes=max_input_bytes,
    )
    return connection, resumed.session


async def publish(store: SessionStore, sid: str, *types: str, **journal: int) -> list[int]:
    """Journaled events of the given types, published as a worker does; their seqs."""
    items = [PublishItem(orjson.dumps({"type": t}), t) for t in types]
    return await store.publish(sid, items, **{**JOURNAL, **journal})


async def inbox(client: Any, worker_id: str) -> list[InboxMessage]:
    """The messages of a worker's inbox, in order, as the worker decodes them."""
    return [
        m for _, fields in await client.xrange(KEYS.inbox(worker_id)) for m in decode_entry(fields)
    ]


def janitor_on(
    handle: Any, keys: KeySchema = KEYS, live_client: Any = None, steady: Any = None
) -> tuple[Any, WorkerClient]:
    """The API pod's janitor as its pod builds it, on `handle` (a `RedisHandle`), with the
    WorkerClient it closes sessions through (stop it after); `live_client`: the client its
    live hub publishes on (the handle's pub/sub client by default)."""
    from services.api.janitor import Janitor
    from shared.contracts import SessionRuntimeConfig

    client = handle.client
    store = SessionStore(client, keys)
    workers = WorkerClient(InboxWriter(client, keys, store.scripts))
    live = live_client if live_client is not None else handle.pubsub_client()
    janitor = Janitor(
        handle,
        keys,
        store,
        workers,
        SessionRuntimeConfig(),
        heartbeat_ttl_s=5.0,
        disconnect_grace_s=30.0,
        directory=WorkerDirectory(client, keys, heartbeat_ttl_s=5.0),
        live=LiveHub(live, keys.api("api-t")),
        steady=steady,
    )
    return janitor, workers


def steady_since_long_ago(janitor: Any) -> None:
    """The janitor's dead sweeps judge heartbeats at once, as if Redis had answered its pod
    for longer than the TTL (a fresh janitor waits a TTL first: `SteadyRedis`)."""
    import math

    from services.api.liveness import SteadyRedis

    janitor.steady = SteadyRedis(0.0, gap_s=math.inf)
    janitor.steady.tick()
    janitor._ticks_own = False
