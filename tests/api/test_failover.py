"""Failover in the dead-worker sweep (services/api/failover.py, services/api/janitor.py), on a
real redis-server, the 3-master Redis Cluster and fakeredis: a dead worker's sessions with a
checkpoint are re-placed on a live worker (owner moved, restore entry first, then the
session's commands the dead worker never handled, in order and unchanged, the `moved`
notice published); the others still end with worker_lost."""

import time
import uuid

import orjson
import pytest

from shared.protocol.duplex import AppendAudio, Heartbeat
from shared.redis.boundary import (
    ChatRequest,
    CloseRequest,
    CommandRecord,
    InboxMessage,
    InboxRecord,
    OpenRequest,
    RestoreRequest,
    TouchRequest,
    decode_entry,
)
from shared.redis.connection import RedisHandle
from shared.redis.store import PublishItem
from tests.api.parts import (
    JOURNAL,
    KEYS,
    active_session,
    janitor_on,
    register_worker,
    steady_since_long_ago,
)
from tests.redis.sharded_listener import listener_of

DEAD = "w-dead"
CHECKPOINT = b'{"v":1,"items":[]}'


@pytest.fixture
async def janitor(redis_client):
    factory = getattr(redis_client, "pubsub_client", None)  # a cluster client has no PUBLISH
    live_client = factory() if factory else redis_client
    janitor, workers = janitor_on(RedisHandle(redis_client, "test"), live_client=live_client)
    steady_since_long_ago(janitor)
    yield janitor
    await workers.stop()
    if factory:
        await live_client.aclose()


def sid() -> str:
    # a channel of its own: on a cluster, an earlier test's messages may still be in flight
    return f"duplex-{uuid.uuid4().hex[:12]}"


async def dead_worker(client, worker_id: str = DEAD) -> None:
    await register_worker(client, worker_id, beat_age_s=60)


async def session_on(janitor, session_id: str, *, checkpoint: bool = True) -> None:
    """An active session of the dead worker, with a checkpoint written as its worker does
    (fenced on owner generation 1, in the same call as an event)."""
    await active_session(janitor.store, session_id, worker=DEAD)
    await janitor.client.sadd(KEYS.worker_sessions(DEAD), session_id)
    item = PublishItem(b'{"type":"conversation.item.done"}', "conversation.item.done")
    cp = CHECKPOINT if checkpoint else b""
    assert await janitor.store.publish(
        session_id, [item], owner_generation=1, checkpoint=cp, **JOURNAL
    ) == [1]


async def to_inbox(janitor, worker_id: str, *records: InboxRecord) -> None:
    for record in records:
        await janitor.store.inbox_append(worker_id, record.to_fields())


async def entries(client, worker_id: str, session_id: str | None = None) -> list[InboxMessage]:
    """The inbox's messages (of one session), in order."""
    return [
        message
        for _, fields in await client.xrange(KEYS.inbox(worker_id))
        for message in decode_entry(fields)
        if session_id is None or message.session_id == session_id
    ]


def marks(messages: list[InboxMessage]) -> list[tuple[str, int]]:
    return [(type(m).__name__, getattr(m, "seq", 0)) for m in messages]


async def journal_types(janitor, session_id: str) -> list[str]:
    return [orjson.loads(data)["type"] for _, data in await janitor.store.journal(session_id, 0)]


async def subscribed(client, *channels: str):
    pubsub = listener_of(client)
    for channel in channels:
        await pubsub.subscribe(channel)  # first: a cluster forwards publishes asynchronously
        await pubsub.get_message(timeout=1)  # the confirmation
    return pubsub


async def notices(pubsub, count: int) -> dict[str, bytes]:
    got: dict[str, bytes] = {}
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
        if message and message["type"] in ("message", "smessage"):
            got[message["channel"].decode()] = message["data"]
    await pubsub.aclose()
    return got


async def test_a_dead_workers_sessions_with_a_checkpoint_go_on_on_a_live_worker(janitor):
    client = janitor.client
    await dead_worker(client)
    await register_worker(client, "w-live")
    active, detached, bare = sid(), sid(), sid()
    await session_on(janitor, active)
    await session_on(janitor, detached)
    assert await janitor.store.detach(detached, 1, grace_ms=30_000) == 1  # in its grace
    await session_on(janitor, bare, checkpoint=False)
    await to_inbox(
        janitor,
        DEAD,
        CommandRecord(active, 1, 7, Heartbeat(event_id="c7")),
        CommandRecord(bare, 1, 3, Heartbeat(event_id="b3")),
        CommandRecord(active, 1, 8, AppendAudio(audio=b"\x01\x02" * 50, event_id="c8")),
        ChatRequest("chat-1", [{"role": "user", "content": "hi"}]),
        TouchRequest(active, 2),
        CloseRequest(detached, "disconnect_grace_expired", 0),
        OpenRequest(sid(), {"model": "echo"}),
        RestoreRequest(active, 1, "drain", "w-other"),  # superseded by the new one
    )
    unread = {s: await entries(client, DEAD, s) for s in (active, detached)}
    pubsub = await subscribed(client, KEYS.live(active), KEYS.live(detached))

    assert await janitor.sweep_dead_workers() == [bare]  # only it is closed

    for session_id in (active, detached):
        meta = await janitor.store.meta(session_id)
        assert (meta["worker"], meta["owner_generation"]) == ("w-live", "2")
        assert (meta["moved_from"], meta["moved_why"]) == (DEAD, "worker_lost")
        assert await journal_types(janitor, session_id) == ["conversation.item.done"]
        [restore, *forwarded] = await entries(client, "w-live", session_id)
        assert restore == RestoreRequest(session_id, 2, "worker_lost", DEAD)
        # the messages the dead worker never handled, in order, as they were
        assert forwarded == [m for m in unread[session_id] if not isinstance(m, RestoreRequest)]
    assert marks(await entries(client, "w-live", active)) == [
        ("RestoreRequest", 0),
        ("CommandRecord", 7),
        ("CommandRecord", 8),
        ("TouchRequest", 0),
    ]
    assert (await janitor.store.meta(detached))["state"] == "detached"
    assert await client.zscore(KEYS.leases(), detached) is not None  # still in its grace
    assert {m.decode() for m in await client.smembers(KEYS.worker_sessions("w-live"))} == {
        active,
        detached,
    }
    assert await notices(pubsub, 2) == {
        KEYS.live(active): b"!moved 2 w-live",
        KEYS.live(detached): b"!moved 2 w-live",
    }
    assert await journal_types(janitor, bare) == [
        "conversation.item.done",
        "error",
        "session.closed",
    ]
    assert not await entries(client, "w-live", bare)
    for key in (
        KEYS.inbox(DEAD),
        KEYS.inbox_bytes(DEAD),
        KEYS.worker(DEAD),
        KEYS.worker_sessions(DEAD),
    ):
        assert await client.exists(key) == 0
    assert await client.zscore(KEYS.workers(), DEAD) is None
    assert await janitor.sweep_dead_workers() == []


async def test_with_no_live_worker_with_room_the_session_ends_with_worker_lost(janitor):
    client = janitor.client
    await dead_worker(client)
    await register_worker(client, "w-drain")
    await client.hset(KEYS.worker("w-drain"), "draining", 1)  # takes nothing new
    await register_worker(client, "w-full", max_sessions=1)
    await client.hset(KEYS.worker("w-full"), "active", 1)
    await register_worker(client, "w-other-model", model="other")
    lost = sid()
    await session_on(janitor, lost)
    await to_inbox(janitor, DEAD, CommandRecord(lost, 1, 1, Heartbeat(event_id="h")))
    assert await janitor.sweep_dead_workers() == [lost]
    meta = await janitor.store.meta(lost)
    assert (meta["state"], meta["worker"], meta["owner_generation"]) == ("closed", DEAD, "1")
    [_, error, closed] = [orjson.loads(d) for _, d in await janitor.store.journal(lost, 0)]
    assert error["error"]["code"] == "worker_lost" and error["error"]["retryable"] is True
    assert (closed["type"], closed["reason"]) == ("session.closed", "worker_lost")
    assert await client.exists(KEYS.checkpoint(lost)) == 0  # session.closed deletes it
    for worker in ("w-drain", "w-full", "w-other-model"):
        assert await entries(client, worker) == []


async def test_a_draining_worker_is_never_chosen_and_the_sweep_counts_its_own_moves(janitor):
    client = janitor.client
    await dead_worker(client)
    await register_worker(client, "w-drain", max_sessions=16)
    await client.hset(KEYS.worker("w-drain"), "draining", 1)
    await register_worker(client, "w-b", max_sessions=3)  # room for 3 of the 4
    sessions = [sid() for _ in range(4)]
    for session_id in sessions:
        await session_on(janitor, session_id)
    lost = await janitor.sweep_dead_workers()
    owners = {s: (await janitor.store.meta(s))["worker"] for s in sessions}
    assert len(lost) == 1 and owners[lost[0]] == DEAD
    assert sorted(w for s, w in owners.items() if s not in lost) == ["w-b"] * 3
    assert await entries(client, "w-drain") == []
    restores = [m.session_id for m in await entries(client, "w-b") if isinstance(m, RestoreRequest)]
    assert sorted(restores) == sorted(s for s in sessions if s not in lost)


async def test_what_is_not_the_dead_workers_to_move_is_left_or_closed_as_before(janitor):
    client = janitor.client
    await dead_worker(client)
    await register_worker(client, "w-b")
    elsewhere, opening = sid(), sid()
    # moved away already (a drain, an earlier sweep): still in the dead worker's set
    await session_on(janitor, elsewhere)
    assert await janitor.store.move_owner(elsewhere, DEAD, "w-b", "drain") == 2
    # not admitted yet: its opener hears worker_lost
    await janitor.store.open(opening, DEAD, "echo", "", "{}")
    await client.set(KEYS.checkpoint(opening), CHECKPOINT)
    await client.sadd(KEYS.worker_sessions(DEAD), opening)
    assert await janitor.sweep_dead_workers() == [opening]
    assert await journal_types(janitor, elsewhere) == ["conversation.item.done"]
    assert (await janitor.store.meta(elsewhere))["worker"] == "w-b"
    assert await journal_types(janitor, opening) == ["error", "session.closed"]
    assert await entries(client, "w-b") == []


async def test_commands_that_reach_the_dead_inbox_during_the_sweep_are_forwarded(janitor):
    """An API pod that has not heard the `moved` notice yet still writes to the dead
    worker's inbox: those entries follow the others to the new worker."""
    client = janitor.client
    await dead_worker(client)
    await register_worker(client, "w-b")
    moving = sid()
    await session_on(janitor, moving)
    await to_inbox(janitor, DEAD, CommandRecord(moving, 1, 1, Heartbeat(event_id="h1")))
    move = janitor.failover.move

    async def late_writer(loss, session_id, meta):
        outcome = await move(loss, session_id, meta)
        late = CommandRecord(moving, 1, 2, Heartbeat(event_id="h2"))
        await to_inbox(janitor, DEAD, late)  # after the read, before the keys go
        return outcome

    janitor.failover.move = late_writer
    assert await janitor.sweep_dead_workers() == []
    assert marks(await entries(client, "w-b", moving)) == [
        ("RestoreRequest", 0),
        ("CommandRecord", 1),
        ("CommandRecord", 2),
    ]
    assert await client.exists(KEYS.inbox(DEAD)) == 0


async def test_a_worker_restarted_under_the_dead_ones_id_during_the_sweep_keeps_its_keys(janitor):
    """A StatefulSet pod comes back under its name while its sweep runs: it takes its
    sessions back itself (`adopt`, a newer owner generation), so the sweep neither moves
    them nor deletes the registration, inbox and session set the new process uses."""
    client = janitor.client
    await dead_worker(client)
    await register_worker(client, "w-live")
    session_id = sid()
    await session_on(janitor, session_id)
    begin = janitor.failover.begin

    async def restarted_meanwhile(dead):
        loss = await begin(dead)
        # the new process: registered again, the session moved to itself (generation 2)
        assert await janitor.store.move_owner(session_id, DEAD, DEAD, "worker_lost", 1) == 2
        await register_worker(client, DEAD)
        return loss

    janitor.failover.begin = restarted_meanwhile
    await janitor.sweep_dead_workers()
    meta = await janitor.store.meta(session_id)
    assert (meta["worker"], meta["owner_generation"]) == (DEAD, "2")
    assert await client.zscore(KEYS.workers(), DEAD) is not None
    assert await client.exists(KEYS.worker(DEAD), KEYS.worker_sessions(DEAD)) == 2
