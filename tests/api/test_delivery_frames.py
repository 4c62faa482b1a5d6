"""Delivery of framed live messages (services/api/delivery.py, shared/redis/live_message.py):
a publisher round's events split in order, routed on their header without their JSON
parsed, replay and gap fill exact from the journal, with or without the seq in the JSON."""

import asyncio

import orjson
import pytest

from services.api.live import LiveFeed
from shared.protocol.duplex import SessionResume
from shared.redis.live_message import LiveRecord
from shared.redis.store import PublishItem
from tests.api.parts import JOURNAL, active_session, make_parts

SID = "duplex-f"


@pytest.fixture
async def parts():
    parts = make_parts()
    yield parts
    await parts.close()


async def attached(parts, *, last_seq: int = 0):
    feed = LiveFeed()
    attachment = parts.attachment(feed)
    await attachment.resume(
        SessionResume(session_id=SID, resume_token="tok", last_received_server_event_seq=last_seq)
    )
    delivery = parts.delivery(attachment, feed)
    delivery.last_seq = last_seq
    return attachment, delivery


async def sent(delivery, count: int) -> list[tuple[str, str | None, bytes]]:
    """The next `count` items the writer would send: (type, response id, bytes)."""
    items = [await delivery.get() for _ in range(count)]
    return [(item.wire_type, item.response_id, item.data) for item in items]


def frame(*records: LiveRecord) -> bytes:
    return b"".join(record.to_bytes() for record in records)


async def test_a_rounds_events_are_split_in_order_and_sent_byte_for_byte(parts):
    await active_session(parts.store, SID)
    await parts.hub.start()
    _, delivery = await attached(parts)
    pump = asyncio.create_task(delivery.pump())
    delta = "response.output_audio.delta"
    items = [
        PublishItem(b'{"type":"response.created","n":1}', "response.created", response_id="r1"),
        PublishItem(b'{"type":"response.output_audio.delta","n":2}', delta, response_id="r1"),
        PublishItem(b'{"type":"rate_limits.updated","n":3}', "rate_limits.updated"),
    ]
    assert await parts.store.publish(SID, items, stamp_seq=False, **JOURNAL) == [1, 2, 3]
    assert await sent(delivery, 3) == [(i.wire_type, i.response_id, i.data) for i in items]
    assert delivery.last_seq == 3
    pump.cancel()


async def test_a_record_is_routed_on_its_header_without_its_json_parsed(parts):
    """A body that is not JSON at all still goes out as it came: only the header is read
    (the types whose JSON the pod needs, session objects and errors, are rare)."""
    await active_session(parts.store, SID)
    _, delivery = await attached(parts)
    opaque = b"\x00 not json \n at all"
    delivery.feed.push(
        frame(
            LiveRecord(1, "response.output_audio.delta", "r7", opaque),
            LiveRecord(2, "response.output_audio.delta", "r7", b"{...}"),
        )
    )
    pump = asyncio.create_task(delivery.pump())
    assert await sent(delivery, 2) == [
        ("response.output_audio.delta", "r7", opaque),
        ("response.output_audio.delta", "r7", b"{...}"),
    ]
    pump.cancel()


async def test_session_objects_and_errors_are_read_from_their_json(parts):
    await active_session(parts.store, SID)
    _, delivery = await attached(parts)
    updated = b'{"type":"session.updated","session":{"idle_timeout_s":9}}'
    error = b'{"type":"error","error":{"code":"bad_event","message":"m"}}'
    delivery.feed.push(
        frame(LiveRecord(1, "session.updated", None, updated), LiveRecord(2, "error", None, error))
    )
    pump = asyncio.create_task(delivery.pump())
    assert [data for _, _, data in await sent(delivery, 2)] == [updated, error]
    assert delivery.view.idle_timeout_s == 9.0
    assert parts.metrics.errors.labels("bad_event")._value.get() == 1
    pump.cancel()


async def test_a_cancel_drops_the_queued_audio_of_the_response_its_header_names(parts):
    """The openai surface's response.done has no top-level response_id: the header's is
    what finds the response's queued deltas."""
    await active_session(parts.store, SID)
    _, delivery = await attached(parts)
    cancelled = b'{"type":"response.done","response":{"id":"r1","status":"cancelled"}}'
    delivery.feed.push(
        frame(
            LiveRecord(1, "response.output_audio.delta", "r1", b'{"d":1}'),
            LiveRecord(2, "response.output_audio.delta", "r2", b'{"d":2}'),
            LiveRecord(3, "response.done", "r1", cancelled),
        )
    )
    pump = asyncio.create_task(delivery.pump())
    assert [data for _, _, data in await sent(delivery, 2)] == [b'{"d":2}', cancelled]
    pump.cancel()


async def test_a_gap_is_filled_from_the_journal_exactly_without_seqs_in_the_json(parts):
    """The openai surface: the JSON has no seq; the gap fill reads it from the entry ids,
    and replays each entry with its type and response id as the live records had them."""
    await active_session(parts.store, SID)
    items = [PublishItem(b'{"type":"a","n":%d}' % n, "a", response_id=f"r{n}") for n in range(1, 5)]
    assert await parts.store.publish(SID, items, stamp_seq=False, **JOURNAL) == [1, 2, 3, 4]
    _, delivery = await attached(parts, last_seq=1)
    # records 2 and 3 never came live (the hub was reconnecting); 4 comes, then 3 late
    delivery.feed.push(frame(LiveRecord(4, "a", "r4", items[3].data)))
    delivery.feed.push(frame(LiveRecord(3, "a", "r3", items[2].data)))
    delivery.feed.push(b'{"type":"rate_limits.updated"}')  # bare, unsequenced
    pump = asyncio.create_task(delivery.pump())
    assert await sent(delivery, 4) == [
        ("a", "r2", items[1].data),
        ("a", "r3", items[2].data),
        ("a", "r4", items[3].data),
        ("rate_limits.updated", None, b'{"type":"rate_limits.updated"}'),
    ]
    assert delivery.last_seq == 4
    pump.cancel()


async def test_a_resume_replays_the_journal_as_it_went_live(parts):
    await active_session(parts.store, SID)
    await parts.hub.start()
    items = [PublishItem(b'{"type":"e","n":%d}' % n, "e", response_id="r") for n in range(3)]
    assert await parts.store.publish(SID, items, **JOURNAL) == [1, 2, 3]
    _, delivery = await attached(parts, last_seq=1)
    assert await delivery.replay() is True
    replayed = await sent(delivery, 2)
    assert [orjson.loads(data)["server_event_seq"] for _, _, data in replayed] == [2, 3]
    assert [(t, r) for t, r, _ in replayed] == [("e", "r"), ("e", "r")]
    assert delivery.last_seq == 3


async def test_a_malformed_live_message_is_dropped_and_delivery_goes_on(parts):
    await active_session(parts.store, SID)
    _, delivery = await attached(parts)
    delivery.feed.push(b"1 999 a \n{}")  # its length runs past its end
    delivery.feed.push(frame(LiveRecord(1, "a", None, b"{}")))
    pump = asyncio.create_task(delivery.pump())
    assert await sent(delivery, 1) == [("a", None, b"{}")]
    pump.cancel()
