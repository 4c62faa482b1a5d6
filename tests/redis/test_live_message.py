"""The live message format (shared/redis/live_message.py) and event_publish.lua writing it:
one framed message per publish call, the header's seq/type/response id, the same JSON in
the journal, the openai surface's JSON without seq, SPUBLISH on a cluster."""

import uuid

import orjson
import pytest

from shared.redis.keys import KeySchema
from shared.redis.live_message import (
    CATCHUP_KIND,
    ControlNotice,
    LiveMessageError,
    LiveRecord,
    decode_live,
    header_token,
    is_control,
    response_token,
    split,
)
from shared.redis.store import PublishItem, SessionStore, token_digest
from tests.redis.live_listen import LiveListener

KEYS = KeySchema()
JOURNAL = {"max_bytes": 1 << 20, "ttl_ms": 60_000, "closed_ttl_ms": 5_000}


# ---------------------------------------------------------------- the codec


@pytest.mark.parametrize(
    "record",
    [
        LiveRecord(7, "response.output_audio.delta", "resp_1", b'{"type":"x","delta":"AAA="}'),
        LiveRecord(0, "session.updated", None, b'{"type":"session.updated"}'),  # no response id
        LiveRecord(12, "duplex.raw.ü", "resp with spaces", b"{}"),  # odd type, odd id
        LiveRecord(3, "error", None, b'{"a":"line\\nbreak, 1 2 3\\n"}'),  # escaped breaks
        LiveRecord(10**12, "t", "r", b""),  # an empty body still frames
    ],
)
def test_a_record_round_trips(record):
    assert split(record.to_bytes()) == [record]


def test_a_message_splits_into_its_records_in_order():
    records = [
        LiveRecord(seq, f"type.{seq}", f"resp_{seq}" if seq % 2 else None, b'{"n":%d}' % seq)
        for seq in range(1, 30)
    ]
    message = b"".join(record.to_bytes() for record in records)
    assert split(message) == records


def test_a_bare_json_message_is_one_record_parsed_for_its_routing():
    data = b'{"type":"response.done","response_id":"resp_9","server_event_seq":4}'
    assert split(data) == [LiveRecord(4, "response.done", "resp_9", data)]
    assert split(b'{"type":"session.created"}')[0].seq == 0  # unsequenced


def test_control_notices_are_told_apart_by_their_first_byte():
    assert is_control(b"!takeover 2") and is_control(b"!catchup")
    assert not is_control(b'{"type":"x"}') and not is_control(b"1 2 x \n{}")
    assert not is_control(b"")


def test_one_call_decodes_any_live_message_into_its_typed_form():
    """`decode_live`: a notice, a round's framed records, or a bare event, by the first byte."""
    assert decode_live(ControlNotice.takeover(3).to_bytes()) == ControlNotice("takeover", 3)
    moved = decode_live(ControlNotice.moved(2, "w-b").to_bytes())
    assert isinstance(moved, ControlNotice) and (moved.owner_generation, moved.worker_id) == (
        2,
        "w-b",
    )
    assert decode_live(b"!catchup") == ControlNotice(CATCHUP_KIND)
    framed = [LiveRecord(7, "a", "resp_1", b'{"n":1}'), LiveRecord(0, "b", None, b"{}")]
    assert decode_live(b"".join(r.to_bytes() for r in framed)) == framed
    bare = b'{"type":"error","event_id":"e"}'
    assert decode_live(bare) == [LiveRecord(0, "error", None, bare)]
    with pytest.raises(LiveMessageError):
        decode_live(b"1 10 x \n{}")


@pytest.mark.parametrize(
    "message",
    [
        b"1 10 x \n{}",  # the body is shorter than its length
        b"1 2 x",  # no end of header
        b"one 2 x \n{}",  # not a seq
        b"1 2 x\n{}",  # a field missing
        LiveRecord(1, "a", None, b"{}").to_bytes() + b"garbage",
    ],
)
def test_a_malformed_message_is_refused_whole(message):
    with pytest.raises(LiveMessageError):
        split(message)


def test_header_values_that_would_shift_its_fields_are_refused_or_left_out():
    assert header_token("response.done", "event type") == "response.done"
    for bad in ("a b", "a\nb"):
        with pytest.raises(ValueError):
            header_token(bad, "event type")
    assert response_token("resp 1") == "resp 1"  # the last field: a space is fine
    assert response_token("resp\n1") == "" and response_token(None) == ""


# ---------------------------------------------------------------- event_publish.lua


def journaled(wire_type: str, n: int, response_id: str | None = None, pad: int = 0):
    body = {"type": wire_type, "event_id": f"event_{n}", "n": n, "pad": "x" * pad}
    return PublishItem(orjson.dumps(body), wire_type, response_id=response_id)


async def opened(client, sid: str) -> SessionStore:
    store = SessionStore(client, KEYS)
    await store.open(sid, "worker-a", "echo", token_digest("tok"), "{}")
    created = PublishItem(
        b'{"type":"session.created","event_id":"e0","session":{}}', "session.created", False, b"{}"
    )
    await store.publish(sid, [created], **JOURNAL)
    return store


async def test_a_call_is_one_live_message_and_the_journal_holds_its_records(redis_client):
    sid = f"duplex-{uuid.uuid4().hex}"
    async with LiveListener(redis_client, KEYS.live(sid)) as listener:
        store = await opened(redis_client, sid)
        assert (await listener.records(1))[0].wire_type == "session.created"
        items = [
            journaled("response.created", 1, "resp_1"),
            journaled("response.output_audio.delta", 2, "resp_1"),
            journaled("rate_limits.updated", 3),
        ]
        assert await store.publish(sid, items, **JOURNAL) == [1, 2, 3]
        message = await listener.message()
    records = split(message)  # the three events came in ONE message, in order
    assert [(r.seq, r.wire_type, r.response_id) for r in records] == [
        (1, "response.created", "resp_1"),
        (2, "response.output_audio.delta", "resp_1"),
        (3, "rate_limits.updated", None),
    ]
    for record, item in zip(records, items, strict=True):
        event = orjson.loads(record.data)  # the duplex surface: the seq stamped in the JSON
        assert event == {**orjson.loads(item.data), "server_event_seq": record.seq}
    # the journal holds exactly what went live: a replay routes on it as the pump does
    assert await store.journal_records(sid, 0) == records
    assert await store.journal_records(sid, 1, 2) == records[1:2]
    # ONE entry for the call, id its first seq: the live message's bytes, byte for byte
    [(entry_id, fields)] = await redis_client.xrange(KEYS.events(sid))
    assert entry_id == b"1-1" and fields == {b"last": b"3", b"data": message}


async def test_the_openai_surface_publishes_its_json_without_the_seq(redis_client):
    sid = f"duplex-{uuid.uuid4().hex}"
    async with LiveListener(redis_client, KEYS.live(sid)) as listener:
        store = await opened(redis_client, sid)
        await listener.records(1)
        items = [journaled("response.output_audio.delta", n, "resp_1") for n in (1, 2)]
        assert await store.publish(sid, items, stamp_seq=False, **JOURNAL) == [1, 2]
        message = await listener.message()
        records = split(message)
    assert [r.data for r in records] == [item.data for item in items]  # byte for byte
    assert [r.seq for r in records] == [1, 2]  # the seq is in the header only
    assert await store.journal_records(sid, 0) == records  # and in the entry id
    meta = await store.meta(sid)
    assert int(meta["journal_bytes"]) == len(message)  # the one entry holds the framed records


async def test_an_unjournaled_event_goes_bare_in_its_place_in_the_order(redis_client):
    sid = f"duplex-{uuid.uuid4().hex}"
    async with LiveListener(redis_client, KEYS.live(sid)) as listener:
        store = await opened(redis_client, sid)
        await listener.records(1)
        unjournaled = PublishItem(b'{"type":"x"}', "x", journaled=False)
        items = [journaled("a", 1), unjournaled, journaled("b", 2), journaled("c", 3)]
        assert await store.publish(sid, items, **JOURNAL) == [1, 0, 2, 3]
        messages = [await listener.message() for _ in range(3)]
    assert messages[1] == b'{"type":"x"}'  # alone, as bare JSON: an open's reply reads it so
    assert [[r.seq for r in split(m)] for m in messages] == [[1], [0], [2, 3]]
    # one journal entry for the round all the same, without the unjournaled event
    [(entry_id, fields)] = await redis_client.xrange(KEYS.events(sid))
    assert entry_id == b"1-1" and fields == {b"last": b"3", b"data": messages[0] + messages[2]}
    assert [r.seq for r in await store.journal_records(sid, 1)] == [2, 3]


async def test_a_fenced_call_writes_and_publishes_nothing(redis_client):
    sid = f"duplex-{uuid.uuid4().hex}"
    async with LiveListener(redis_client, KEYS.live(sid)) as listener:
        store = await opened(redis_client, sid)
        await listener.records(1)
        before = await store.meta(sid)
        stale = await store.publish(sid, [journaled("a", 1)], owner_generation=7, **JOURNAL)
        assert stale == [-2]
        assert await store.journal(sid, 0) == [] and await store.meta(sid) == before
        assert await store.publish(sid, [journaled("b", 2)], owner_generation=1, **JOURNAL) == [1]
        # the next message is the owner's: the fenced call published nothing before it
        assert [r.wire_type for r in split(await listener.message())] == ["b"]


async def test_a_steady_call_costs_one_hmget_one_xadd_one_hset_one_publish(
    redis_server,
):
    """The commands inside event_publish.lua, counted by the server (INFO commandstats)."""
    import redis.asyncio as redis_async

    client = redis_async.Redis.from_url(redis_server.url)
    sid = f"duplex-{uuid.uuid4().hex}"
    store = await opened(client, sid)
    await store.publish(sid, [journaled("warm", 0)], **JOURNAL)  # the journal's TTL is set
    await client.config_resetstat()
    rounds, per_round = 5, 4
    for r in range(rounds):
        items = [journaled("e", r * per_round + n) for n in range(per_round)]
        await store.publish(sid, items, **JOURNAL)
    stats = await client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): row["calls"] for name, row in stats.items()}
    inside = {k: v for k, v in calls.items() if k not in ("evalsha", "config|resetstat")}
    assert inside == {
        "hmget": rounds,
        "xadd": rounds,  # one journal entry per call, whatever its number of events
        "hset": rounds,
        "publish": rounds,
    }
    await client.aclose()
