"""Owner fencing: a worker that lost a session (another owns it at a newer generation)
writes nothing for it, and drops it locally without an event."""

import asyncio

import orjson
import pytest

from harness.sessions import appends, sine
from plugins.echo import EchoPlugin
from services.worker.control.manager import SessionManager
from shared.contracts import SessionRuntimeConfig
from shared.protocol.duplex import (
    Commit,
    ConversationItemCreated,
    SessionHeartbeatAck,
)
from shared.redis.keys import KeySchema
from shared.redis.live_message import ControlNotice, split
from shared.redis.store import SessionStore
from tests.redis.live_listen import LiveListener
from tests.worker.publishing import Host, own, publisher_on

ITEM = {"id": "item_1", "type": "message", "role": "user", "content": []}


async def test_a_wrong_owner_generation_writes_nothing(redis_client):
    """Against the real event_publish.lua: fenced out, nothing reaches the journal or the
    checkpoint; the owner (generation 1, as opened) writes both."""
    keys = KeySchema()
    store = SessionStore(redis_client, keys)
    stale, owned = "duplex-fenced", "duplex-owned"
    for sid in (stale, owned):
        await store.open(sid, "w-a", "echo", "", "{}")
    host = Host(lambda sid: orjson.dumps({"v": 1, "of": sid}))
    dropped = host.dropped
    publisher = publisher_on(store, host)
    own(publisher, stale, 2)  # not the session's generation: another worker's
    own(publisher, owned, 1)
    publisher.start()
    try:
        for sid in (stale, owned):
            publisher.emit(sid, SessionHeartbeatAck(session_id=sid))
            publisher.emit(sid, ConversationItemCreated(previous_item_id=None, item=ITEM))
        await publisher.flush()
        assert dropped == [stale]
        assert await store.journal(stale, 0) == []
        assert await store.checkpoint(stale) is None
        assert (await store.meta(stale)).get("next_seq") in (None, "0")
        # later events of the fenced session are not even sent
        publisher.emit(stale, SessionHeartbeatAck(session_id=stale))
        await publisher.flush()
        assert await store.journal(stale, 0) == []
        assert not await publisher.write_checkpoint(stale, b'{"v":1}')

        assert [seq for seq, _ in await store.journal(owned, 0)] == [1, 2]
        assert orjson.loads(await store.checkpoint(owned)) == {"v": 1, "of": owned}
    finally:
        await publisher.stop()


class FencingStore:
    """A store whose publishes succeed until `fence` names the session: then [-2]."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.fence: set[str] = set()
        self.client = None

    async def publish_many(self, writes, **_):
        self.calls.append({w.session_id: [item.wire_type for item in w.items] for w in writes})
        return {
            w.session_id: [-2] if w.session_id in self.fence else list(range(1, len(w.items) + 1))
            for w in writes
        }


async def test_a_fenced_reply_drops_the_session_and_nothing_more_is_sent():
    store = FencingStore()
    publisher = publisher_on(store)
    manager = SessionManager(
        EchoPlugin(), SessionRuntimeConfig(max_sessions=2), publisher, table=publisher.table
    )
    publisher.serve(manager.moves)
    publisher.start()
    try:
        opened = await manager.open({"extra_body": {"pace": 1}})  # real time: stays in flight
        sid = opened.session_id
        assert (
            manager.moves.owned_sessions() == {sid: 1}
            and publisher.table.owner_generation(sid) == 1
        )
        await send_all_to(manager, sid, appends(sine(16_000, 1.0), 16_000))
        await manager.submit(sid, Commit(create_response=True))
        while not any("response.created" in call.get(sid, []) for call in store.calls):
            await publisher.flush()
            await asyncio.sleep(0)  # let the runner go on
        store.fence.add(sid)  # another worker owns it from now on
        while sid in manager.table.live_ids():  # the next audio delta is refused: dropped
            await asyncio.sleep(0.01)
        fenced_at = len(store.calls)
        assert manager.moves.owned_sessions() == {}
        await manager.shutdown()  # stops the dropped runner, cleans its stage up
        assert manager.table.slots_in_use == 0
        later = [call[sid] for call in store.calls[fenced_at:] if sid in call]
        assert later == []  # not the cancelled chain, not session.closed: nothing
    finally:
        await publisher.stop()


async def send_all_to(manager, sid, commands) -> None:
    for command in commands:
        await manager.submit(sid, command)


async def test_a_session_whose_hash_is_gone_is_dropped_and_its_sockets_are_told(redis_client):
    """A failover lost the writes that made the session's hash (or Redis restarted empty):
    nothing of it can be journaled again. The worker drops it, as it drops a fenced one,
    and says so once on its live channel (`!lost`), where its API pods end its sockets
    with session.resync_required instead of leaving its client waiting."""
    keys = KeySchema()
    store = SessionStore(redis_client, keys)
    sid = "duplex-lost"
    await store.open(sid, "w-a", "echo", "", "{}")
    host = Host()
    publisher = publisher_on(store, host)
    own(publisher, sid, 1)
    publisher.start()
    try:
        async with LiveListener(redis_client, keys.live(sid)) as live:
            publisher.emit(sid, SessionHeartbeatAck(session_id=sid))
            await publisher.flush()
            assert [record.seq for record in split(await live.message(30))] == [1]
            assert publisher.lost == 0 and host.dropped == []
            await redis_client.delete(keys.session(sid))
            await redis_client.delete(keys.events(sid))
            publisher.emit(sid, SessionHeartbeatAck(session_id=sid))
            await publisher.flush()
            assert host.dropped == [sid] and publisher.lost == 1
            assert ControlNotice.read(await live.message(30)) == ControlNotice.lost()
            publisher.emit(sid, SessionHeartbeatAck(session_id=sid))  # not even sent now
            await publisher.flush()
            assert publisher.lost == 1 and not await redis_client.exists(keys.session(sid))
            with pytest.raises(TimeoutError):  # nothing more on the channel
                await live.message(0.3)
    finally:
        await publisher.stop()
