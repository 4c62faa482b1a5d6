"""Delivery (services/api/delivery.py): replay then live without a gap or a duplicate, a gap
filled from the journal or answered with resync_required, takeover, and output overflow."""

import asyncio

import orjson
import pytest

from services.api.attachment import AttachmentState
from services.api.live import CATCH_UP, LiveFeed
from shared.protocol.duplex import Heartbeat, SessionResume
from shared.redis.boundary import CloseRequest, CommandRecord, ControlNotice
from tests.api.parts import KEYS, active_session, inbox, make_parts, publish

SID = "duplex-d"
#: an event with no seq, pushed after notices: once the writer has it, the pump has
#: handled every notice before it (one reader, feed order)
MARKER = b'{"type":"rate_limits.updated"}'


@pytest.fixture
async def parts():
    parts = make_parts()
    yield parts
    await parts.close()


async def attached(parts, *, last_seq: int = 0, max_events: int = 512):
    """A resumed attachment (generation 2) and its delivery, replay not yet run."""
    feed = LiveFeed()
    attachment = parts.attachment(feed)
    await attachment.resume(
        SessionResume(session_id=SID, resume_token="tok", last_received_server_event_seq=last_seq)
    )
    delivery = parts.delivery(attachment, feed, max_events=max_events)
    delivery.last_seq = last_seq
    return attachment, delivery


async def journal_data(parts) -> dict[int, bytes]:
    """Each journaled event as the worker published it live (with its server_event_seq)."""
    return dict(await parts.store.journal(SID, 0))


async def taken(delivery, count: int) -> list[tuple[str, int | None]]:
    """The next `count` items the writer would send, as (type, server_event_seq)."""
    out = []
    for _ in range(count):
        event = orjson.loads((await delivery.get()).data)
        out.append((event["type"], event.get("server_event_seq")))
    return out


async def test_replay_then_live_has_no_gap_and_no_duplicate(parts):
    """Through Redis: the hub is subscribed before the lease CAS, so an event published
    between the CAS and the replay arrives twice (journal and live) and is sent once."""
    await active_session(parts.store, SID)
    assert await publish(parts.store, SID, "e1", "e2", "e3") == [1, 2, 3]
    await parts.hub.start()
    _, delivery = await attached(parts, last_seq=1)  # the client had seq 1
    assert await publish(parts.store, SID, "e4") == [4]  # live, and in the journal
    assert await delivery.replay() is True
    pump = asyncio.create_task(delivery.pump())
    await publish(parts.store, SID, "e5", "e6")
    assert await taken(delivery, 5) == [("e2", 2), ("e3", 3), ("e4", 4), ("e5", 5), ("e6", 6)]
    assert len(delivery.queue) == 0 and delivery.last_seq == 6
    pump.cancel()


async def test_a_gap_in_the_live_channel_is_filled_from_the_journal(parts):
    await active_session(parts.store, SID)
    await publish(parts.store, SID, "e1", "e2", "e3", "e4")
    live = await journal_data(parts)
    _, delivery = await attached(parts, last_seq=1)
    delivery.feed.push(live[4])  # 2 and 3 never came live (the hub was reconnecting)
    delivery.feed.push(live[3])  # late: already filled
    delivery.feed.push(b'{"type":"rate_limits.updated"}')  # no seq: delivered as it comes
    pump = asyncio.create_task(delivery.pump())
    assert await taken(delivery, 4) == [
        ("e2", 2),
        ("e3", 3),
        ("e4", 4),
        ("rate_limits.updated", None),
    ]
    pump.cancel()


async def test_catch_up_replays_what_the_journal_has_past_the_last_seq(parts):
    await active_session(parts.store, SID)
    await publish(parts.store, SID, "e1", "e2")
    _, delivery = await attached(parts, last_seq=1)
    delivery.feed.push(CATCH_UP)
    pump = asyncio.create_task(delivery.pump())
    assert await taken(delivery, 1) == [("e2", 2)]
    pump.cancel()


async def test_a_gap_the_journal_no_longer_covers_ends_delivery_with_resync_required(parts):
    await active_session(parts.store, SID)
    await publish(parts.store, SID, "e1", "e2", "e3")
    _, delivery = await attached(parts, last_seq=1)
    # then e4 pushes the journal past its byte cap: the oldest entries are trimmed
    await publish(parts.store, SID, "e4", max_bytes=100)
    live = await journal_data(parts)
    assert 2 not in live and 4 in live  # whole rounds trimmed: 2 is gone, with 3 or not
    delivery.feed.push(live[4])
    pump = asyncio.create_task(delivery.pump())
    item = await delivery.get()
    assert item.wire_type == "session.resync_required"
    event = orjson.loads(item.data)
    assert (event["session_id"], event["reason"]) == (SID, "journal_gap")
    await pump  # delivery ends there: never a silent hole
    assert len(delivery.queue) == 0


async def test_a_journal_overflow_notice_is_delivered_as_published(parts):
    await active_session(parts.store, SID)
    await parts.hub.start()
    _, delivery = await attached(parts)
    pump = asyncio.create_task(delivery.pump())
    assert await publish(parts.store, SID, "response.done", max_bytes=8) == [0]  # too large
    [(kind, seq), (done, done_seq)] = await taken(delivery, 2)
    assert (kind, seq, done, done_seq) == ("session.resync_required", None, "response.done", None)
    pump.cancel()


async def test_a_takeover_replaces_this_socket_and_ends_delivery(parts):
    await active_session(parts.store, SID)
    attachment, delivery = await attached(parts)
    delivery.feed.push(b"!takeover 2")  # our own generation's notice
    delivery.feed.push(b"!takeover 3")
    pump = asyncio.create_task(delivery.pump())
    await pump
    assert attachment.state is AttachmentState.REPLACED
    [item] = [await delivery.get()]
    assert orjson.loads(item.data) == {
        "type": "session.replaced",
        "event_id": orjson.loads(item.data)["event_id"],
        "session_id": SID,
        "attachment_generation": 2,
    }


async def test_a_closure_ends_the_attachment_and_session_objects_update_the_view(parts):
    await active_session(parts.store, SID)
    attachment, delivery = await attached(parts)
    updated = {"type": "session.updated", "session": {"idle_timeout_s": 7}}
    delivery.enqueue(orjson.dumps(updated), updated)
    assert delivery.view.idle_timeout_s == 7.0
    assert attachment.state is AttachmentState.ATTACHED
    closed = {"type": "session.closed", "session_id": SID}
    delivery.enqueue(orjson.dumps(closed), closed)
    assert attachment.state is AttachmentState.ENDED and attachment.live is False


async def test_an_overflowing_client_hears_why_and_the_worker_is_asked_once_to_close(parts):
    await active_session(parts.store, SID)
    attachment, delivery = await attached(parts, max_events=2)
    for n in range(4):
        event = {"type": "response.output_audio.delta", "delta": str(n)}
        delivery.enqueue(orjson.dumps(event), event)
    assert delivery.queue.overflowed
    await delivery.overflow_close
    queued = [orjson.loads((await delivery.get()).data) for _ in range(3)]
    assert [e.get("delta") for e in queued[:2]] == ["0", "1"]
    assert queued[2]["error"]["code"] == "output_overflow"
    assert queued[2]["error"]["message"] == "the client reads too slowly; the session is closed"
    closes = [e for e in await inbox(parts.client, "worker-a") if isinstance(e, CloseRequest)]
    assert closes == [CloseRequest(SID, "output_overflow", 2)]
    assert parts.metrics.errors.labels("output_overflow")._value.get() == 1
    assert attachment.state is AttachmentState.ATTACHED  # the worker's session.closed ends it


async def heartbeat_inboxes(parts, attachment, *workers: str) -> dict[str, list]:
    """Send a heartbeat; each worker's inbox as (kind, attachment, seq)."""
    await attachment.command(Heartbeat(event_id="h"))
    return {
        worker: [(type(e), e.attachment, e.seq) for e in await inbox(parts.client, worker)]
        for worker in workers
    }


async def test_a_moved_notice_routes_the_commands_to_the_new_worker(parts):
    """Through Redis: a drain or a failover publishes `!moved <owner generation> <worker>`
    on the live channel; commands after it go to the new worker's inbox, and notices of an
    owner generation not newer than the one routed by (late, reordered) change nothing."""
    await active_session(parts.store, SID)
    await parts.hub.start()
    attachment, delivery = await attached(parts)
    assert await heartbeat_inboxes(parts, attachment, "worker-a") == {
        "worker-a": [(CommandRecord, 2, 1)]
    }
    pump = asyncio.create_task(delivery.pump())
    for notice in (
        ControlNotice.moved(2, "worker-b"),
        ControlNotice.moved(1, "worker-c"),  # older: stale
        ControlNotice.moved(2, "worker-c"),  # the same generation: not newer
    ):
        await parts.hub.publish(KEYS.live(SID), notice.to_bytes())
    await parts.hub.publish(KEYS.live(SID), MARKER)
    assert await taken(delivery, 1) == [("rate_limits.updated", None)]  # no notice is sent
    assert (attachment.worker_id, attachment.owner_generation) == ("worker-b", 2)
    assert await heartbeat_inboxes(parts, attachment, "worker-a", "worker-b", "worker-c") == {
        "worker-a": [(CommandRecord, 2, 1)],
        "worker-b": [(CommandRecord, 2, 2)],  # the seqs go on: the worker orders by them
        "worker-c": [],
    }
    assert attachment.state is AttachmentState.ATTACHED and len(delivery.queue) == 0
    pump.cancel()


async def test_catch_up_reads_the_owner_from_the_hash_when_a_moved_notice_was_lost(parts):
    await active_session(parts.store, SID)
    await publish(parts.store, SID, "e1")
    attachment, delivery = await attached(parts)
    # moved while the hub was reconnecting: the notice never came
    assert await parts.store.move_owner(SID, "worker-a", "worker-b", "worker_lost") == 2
    delivery.feed.push(CATCH_UP)
    pump = asyncio.create_task(delivery.pump())
    assert await taken(delivery, 1) == [("e1", 1)]  # the catch-up's replay
    assert (attachment.worker_id, attachment.owner_generation) == ("worker-b", 2)
    assert await heartbeat_inboxes(parts, attachment, "worker-a", "worker-b") == {
        "worker-a": [],
        "worker-b": [(CommandRecord, 2, 1)],
    }
    delivery.feed.push(ControlNotice.moved(2, "worker-c").to_bytes())  # its notice, late
    delivery.feed.push(MARKER)
    assert await taken(delivery, 1) == [("rate_limits.updated", None)]
    assert attachment.worker_id == "worker-b"
    pump.cancel()


async def test_another_event_under_a_seq_the_client_has_ends_in_resync(parts):
    """A Redis failover lost the writes that journaled the client's last events: the store
    went back to seq 1 and the writer's next event reuses seq 2. The client must not get a
    second event under seq 2 (nor a seq below 3): it is told to resync. The same event again
    under its seq (a replay overlapping the live channel) is still a plain duplicate."""
    await active_session(parts.store, SID)
    for event_type in ("e1", "e2", "e3"):  # one round each: journal entries 1-1, 2-1, 3-1
        await publish(parts.store, SID, event_type)
    live = await journal_data(parts)
    _, delivery = await attached(parts, last_seq=0)
    for seq in (1, 2, 3):
        delivery.feed.push(live[seq])
    delivery.feed.push(live[3])  # the same event again: skipped
    delivery.feed.push(MARKER)
    pump = asyncio.create_task(delivery.pump())
    assert await taken(delivery, 4) == [
        ("e1", 1), ("e2", 2), ("e3", 3), ("rate_limits.updated", None)
    ]
    # what the promoted replica holds: the journal and the counter as of seq 1
    [(entry_id, fields)] = await parts.client.xrange(KEYS.events(SID), "1-1", "1-1")
    await parts.client.delete(KEYS.events(SID))
    await parts.client.xadd(KEYS.events(SID), fields, id=entry_id)
    await parts.client.hset(KEYS.session(SID), "next_seq", 1)
    assert await publish(parts.store, SID, "x2") == [2]
    delivery.feed.push((await journal_data(parts))[2])
    item = await delivery.get()
    assert item.wire_type == "session.resync_required"
    assert orjson.loads(item.data)["reason"] == "journal_gap"
    await pump  # delivery ends there
    assert len(delivery.queue) == 0 and delivery.last_seq == 3
    assert delivery.metrics.store_regressions._value.get() == 1


async def test_a_lost_notice_with_the_hash_gone_ends_the_stream_in_resync(parts):
    """A failover lost the session's hash (or Redis restarted empty): its worker can journal
    nothing for it any more and says so on the live channel. The client is told to start
    again rather than wait for events that cannot come."""
    await active_session(parts.store, SID)
    await publish(parts.store, SID, "e1")
    _, delivery = await attached(parts)
    pump = asyncio.create_task(delivery.pump())
    delivery.feed.push(ControlNotice.lost().to_bytes())  # the hash is still there: stale
    delivery.feed.push(MARKER)
    assert await taken(delivery, 1) == [("rate_limits.updated", None)]
    await parts.client.delete(KEYS.session(SID))
    delivery.feed.push(ControlNotice.lost().to_bytes())
    item = await delivery.get()
    event = orjson.loads(item.data)
    assert (event["type"], event["session_id"], event["reason"]) == (
        "session.resync_required",
        SID,
        "journal_gap",
    )
    await pump  # delivery ends there
    assert delivery.metrics.sessions_lost._value.get() == 1


async def test_catch_up_with_the_hash_gone_ends_the_stream_in_resync(parts):
    """The `lost` notice went while the hub was reconnecting: the catch-up finds the hash
    gone itself."""
    await active_session(parts.store, SID)
    _, delivery = await attached(parts)
    await parts.client.delete(KEYS.session(SID))
    delivery.feed.push(CATCH_UP)
    pump = asyncio.create_task(delivery.pump())
    item = await delivery.get()
    assert (item.wire_type, orjson.loads(item.data)["reason"]) == (
        "session.resync_required",
        "journal_gap",
    )
    await pump
    assert len(delivery.queue) == 0 and delivery.metrics.sessions_lost._value.get() == 1
