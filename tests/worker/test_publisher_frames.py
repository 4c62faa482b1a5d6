"""The publisher's live messages: a session's events of one round in one message, each
with its response's id in its header, and an openai-surface session's JSON without seq;
the openai surface's audio delta built GA's way directly (surface.py)."""

import asyncio

import orjson

from services.worker.engine import surface
from shared.protocol.duplex import (
    DuplexOutputAudioDelta,
    DuplexResponseDone,
    RateLimitsUpdated,
)
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from shared.redis.live_message import split
from shared.redis.store import SessionStore
from tests.worker.publishing import Host, own, publisher_on

KEYS = KeySchema()
SCOPE = {"response_id": "resp_1", "item_id": "item_1", "output_index": 0, "content_index": 0}


def delta(n: int) -> DuplexOutputAudioDelta:
    return DuplexOutputAudioDelta(**SCOPE, delta=f"AAA{n}", format="pcm16", metadata={"n": n})


async def published_round(stamp_seq: bool) -> list:
    """Three events emitted in one turn of the loop, published; the live messages."""
    handle = connect(None)
    store = SessionStore(handle.client, KEYS)
    sid = "duplex-frames"
    await store.open(sid, "w", "echo", "", "{}")
    pubsub = handle.new_client().pubsub()
    await pubsub.subscribe(KEYS.live(sid))
    await pubsub.get_message(timeout=1)
    publisher = publisher_on(store)
    own(publisher, sid, 1, openai=not stamp_seq)
    publisher.start()
    done = DuplexResponseDone(response={"id": "resp_1", "status": "cancelled"})  # no top-level id
    for event in (delta(1), delta(2), done, RateLimitsUpdated(rate_limits=[])):
        publisher.emit(sid, event)
    await publisher.flush()
    messages = []
    async with asyncio.timeout(5):
        while True:
            message = await pubsub.get_message(timeout=0.2)
            if message is None:
                break
            if message["type"] == "message":
                messages.append(message["data"])
    records = await store.journal_records(sid, 0)
    await publisher.stop()
    await pubsub.aclose()
    await handle.close()
    return [messages, records]


async def test_a_round_of_one_session_is_one_message_with_response_ids_in_its_headers():
    messages, journal = await published_round(stamp_seq=True)
    [message] = messages
    records = split(message)
    assert [(r.seq, r.wire_type, r.response_id) for r in records] == [
        (1, "response.output_audio.delta", "resp_1"),
        (2, "response.output_audio.delta", "resp_1"),
        (3, "response.done", "resp_1"),  # from its response object
        (4, "rate_limits.updated", None),
    ]
    assert [orjson.loads(r.data)["server_event_seq"] for r in records] == [1, 2, 3, 4]
    assert journal == records


async def test_an_openai_surface_session_publishes_without_the_seq_in_its_json():
    messages, journal = await published_round(stamp_seq=False)
    records = [record for message in messages for record in split(message)]
    assert [r.seq for r in records] == [1, 2, 3, 4]
    assert all("server_event_seq" not in orjson.loads(r.data) for r in records)
    assert journal == records


def test_the_ga_audio_delta_is_what_the_projection_made_of_the_duplex_one():
    # what response.audio_events builds on the openai surface (ga=True)
    ga = DuplexOutputAudioDelta(**SCOPE, delta="AAA1")
    projected = surface.project(delta(1), session=None)  # type: ignore[arg-type]
    assert orjson.loads(ga.to_json()) == {
        **orjson.loads(projected.to_json()),
        "event_id": ga.event_id,
    }
    assert surface.project(ga, session=None) is ga  # already GA's: passed as it is


async def test_after_the_store_went_back_in_time_the_worker_goes_on_from_its_own_seq():
    """A Redis failover promoted a replica that had not received seqs 3 and 4, which
    clients already have: the worker's next event is 5, not 3 (its record's seq floor)."""
    handle = connect(None)
    store = SessionStore(handle.client, KEYS)
    sid = "duplex-floor"
    await store.open(sid, "w", "echo", "", "{}")
    publisher = publisher_on(store)
    record = own(publisher, sid, 1, openai=False)
    publisher.start()
    try:
        for n in (1, 2):
            publisher.emit(sid, delta(n))
            await publisher.flush()  # one round each
        for n in (3, 4):
            publisher.emit(sid, delta(n))
            await publisher.flush()
        assert record.journaled_seq == 4
        # the promoted replica's state: the session as of seq 2
        await handle.client.hset(KEYS.session(sid), mapping={"next_seq": 2})
        kept = (await handle.client.xrange(KEYS.events(sid)))[:2]
        await handle.client.delete(KEYS.events(sid))
        for entry_id, fields in kept:
            await handle.client.xadd(KEYS.events(sid), fields, id=entry_id)
        publisher.emit(sid, delta(5))
        await publisher.flush()
        assert [r.seq for r in await store.journal_records(sid, 0)] == [5]
        assert record.journaled_seq == 5
        assert (await store.meta(sid))["seq_regressions"] == "1"
    finally:
        await publisher.stop()
        await handle.close()


async def test_a_model_round_for_a_session_whose_hash_is_gone_is_not_sent_again_at_once():
    """A failover (or an empty restart) lost a new session's hash: its model history's
    round is answered [-1]; it was re-queued at once and sent again, a thousand times a
    second. Now it waits for the next second's model write like any other."""
    from shared.contracts import ModelHistory

    handle = connect(None)
    store = SessionStore(handle.client, KEYS)
    sid = "duplex-gone"
    publisher = publisher_on(store)
    record = own(publisher, sid, 1)
    record.history = ModelHistory(4, b"")

    host = Host()
    host.histories[sid] = record.history
    publisher.serve(host)
    calls = 0
    real = store.publish_many

    async def counted(writes, **journal):
        nonlocal calls
        calls += 1
        return await real(writes, **journal)

    store.publish_many = counted  # type: ignore[method-assign]
    publisher.start()
    try:
        record.history.append(b"\x01\x02\x03\x04")
        publisher.queue_model_writes()
        await publisher.flush()
        await asyncio.sleep(0.2)  # a hot loop would send hundreds of calls meanwhile
        assert calls == 1 and not record.history.behind
        assert host.dropped == [sid]  # a session served here, lost by Redis: dropped
    finally:
        await publisher.stop()
        await handle.close()
