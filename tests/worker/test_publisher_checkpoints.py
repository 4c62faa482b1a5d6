"""The publisher writes a session's checkpoint with the batch that holds a durable event of
it, a drain's final checkpoint after the session's pending events, and keeps a failed
batch's checkpoints for its retry."""

import orjson

from services.worker.publisher import RedisEventPublisher
from shared.protocol.duplex import (
    ConversationItemCreated,
    DuplexResponseDone,
    SessionHeartbeatAck,
)
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from shared.redis.store import SessionStore
from tests.worker.publishing import Host, own, publisher_on

SID = "duplex-ckpt"
ITEM = {"id": "item_1", "type": "message", "role": "user", "content": []}


def heartbeat():
    return SessionHeartbeatAck(session_id=SID)


def item_created():
    return ConversationItemCreated(previous_item_id=None, item=ITEM)


class RecordingStore:
    """Records each publish_many call; the first `failures` calls raise."""

    def __init__(self, failures: int = 0) -> None:
        self.calls: list[tuple[dict, dict, dict]] = []
        self.failures = failures
        self.client = None

    async def publish_many(self, writes, **_):
        types = {w.session_id: [item.wire_type for item in w.items] for w in writes}
        owners = {w.session_id: w.owner_generation for w in writes if w.owner_generation}
        checkpoints = {w.session_id: w.checkpoint for w in writes if w.checkpoint}
        self.calls.append((types, owners, checkpoints))
        if self.failures:
            self.failures -= 1
            raise ConnectionError("redis away")
        return {w.session_id: list(range(1, len(w.items) + 1)) for w in writes}


class Snapshots:
    def __init__(self) -> None:
        self.taken = 0

    def __call__(self, session_id: str) -> bytes:
        self.taken += 1
        return orjson.dumps({"v": 1, "n": self.taken})


def make(store, snapshot=None) -> RedisEventPublisher:
    publisher = publisher_on(store, Host(snapshot or Snapshots()))
    own(publisher, SID, 4)
    publisher.start()
    return publisher


async def test_durable_events_carry_a_checkpoint_and_others_do_not():
    store, snapshots = RecordingStore(), Snapshots()
    publisher = make(store, snapshots)
    try:
        publisher.emit(SID, heartbeat())
        await publisher.flush()
        publisher.emit(SID, item_created())
        publisher.emit(SID, heartbeat())
        await publisher.flush()
        publisher.emit(SID, DuplexResponseDone(response_id="resp_1", response={"id": "resp_1"}))
        await publisher.flush()
    finally:
        await publisher.stop()
    assert [(types, owners) for types, owners, _ in store.calls] == [
        ({SID: ["session.heartbeat_ack"]}, {SID: 4}),
        ({SID: ["conversation.item.created", "session.heartbeat_ack"]}, {SID: 4}),
        ({SID: ["response.done"]}, {SID: 4}),
    ]
    assert [checkpoints for _, _, checkpoints in store.calls] == [
        {},
        {SID: b'{"v":1,"n":1}'},
        {SID: b'{"v":1,"n":2}'},
    ]
    assert publisher.checkpoints == 2


async def test_a_failed_batch_is_retried_with_its_checkpoint():
    store, snapshots = RecordingStore(failures=1), Snapshots()
    publisher = make(store, snapshots)
    try:
        publisher.emit(SID, item_created())
        await publisher.flush()
    finally:
        await publisher.stop()
    assert len(store.calls) == 2 and snapshots.taken == 1
    assert store.calls[0] == store.calls[1]
    assert store.calls[1][2] == {SID: b'{"v":1,"n":1}'}


async def test_the_final_checkpoint_follows_the_pending_events():
    handle = connect(None)  # the real event_publish.lua on an embedded Redis
    keys = KeySchema()
    store = SessionStore(handle.client, keys)
    await store.open(SID, "w-a", "echo", "", "{}")
    publisher = make(store)
    publisher.table.get(SID).owner_generation = 1  # as opened
    try:
        publisher.emit(SID, item_created())
        publisher.emit(SID, heartbeat())
        final = b'{"v":1,"final":true}'
        assert await publisher.write_checkpoint(SID, final)
        assert [seq for seq, _ in await store.journal(SID, 0)] == [1, 2]
        assert await store.checkpoint(SID) == final
        publisher.table.get(SID).owner_generation = 9  # not the session's generation any more
        assert not await publisher.write_checkpoint(SID, b'{"v":1,"late":true}')
        assert await store.checkpoint(SID) == final
    finally:
        await publisher.stop()
