"""Property-based tests of the journal and lease scripts: random sequences of publish, ack,
detach and resume against a real redis-server, checked after every step against a model
of what the contract says (seqs, journal bounds, generations, token rotation)."""

import asyncio
import uuid

import orjson
import redis.asyncio as redis_async
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.redis.keys import KeySchema
from shared.redis.store import (
    PublishItem,
    ResumeGranted,
    ResumeResync,
    SessionStore,
    SessionStoreError,
    token_digest,
)
from tests.redis.journal_entries import journal_bytes_held, journal_entries

CAP = 4096  # a small journal cap, so pruning happens within a few events
KEYS = KeySchema("prop")

publish_op = st.tuples(
    st.just("publish"),
    st.lists(st.tuples(st.booleans(), st.integers(0, 1500)), min_size=1, max_size=6),
)
ack_op = st.tuples(st.just("ack"), st.integers(-3, 3))  # relative to the head
detach_op = st.tuples(st.just("detach"), st.integers(-1, 1))  # relative to the attachment
resume_op = st.tuples(
    st.just("resume"),
    st.tuples(st.sampled_from(["current", "previous", "forged"]), st.integers(0, 40)),
)
operations = st.lists(st.one_of(publish_op, ack_op, detach_op, resume_op), max_size=25)


def item(n: int, journaled: bool, pad: int) -> PublishItem:
    body = {"type": "test.event", "event_id": f"event_{n:032x}", "pad": "x" * pad}
    return PublishItem(orjson.dumps(body), "test.event", journaled)


class Model:
    """What the contract says the session's Redis state must be."""

    def __init__(self) -> None:
        self.head = 0  # last seq handed out
        self.first = 1  # first seq a resume may still ask for (after acks and pruning)
        self.attachment = 1
        self.lease = 0
        self.token, self.previous = "token-0", None
        self.overflow = False


async def journal_events(client, sid: str) -> list[tuple[int, dict]]:
    """(seq, event) of every record the journal's entries hold, acknowledged or not."""
    entries = await journal_entries(client, sid, KEYS)
    for entry in entries:  # an entry is one publisher round: its id and `last` bound it
        assert [r.seq for r in entry.records] == list(range(entry.first_seq, entry.last_seq + 1))
    return [(r.seq, orjson.loads(r.data)) for entry in entries for r in entry.records]


async def check_invariants(client, store: SessionStore, sid: str, model: Model) -> None:
    meta = await store.meta(sid)
    assert int(meta["next_seq"]) == model.head
    assert int(meta["attachment_generation"]) == model.attachment
    entries = await journal_events(client, sid)
    seqs = [seq for seq, _ in entries]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    for seq, data in entries:
        assert data["server_event_seq"] == seq  # the seq is stamped into the event itself
    if seqs:
        assert seqs == list(range(seqs[0], model.head + 1))  # contiguous up to the head
    stored = await journal_bytes_held(client, sid, KEYS)
    assert int(meta["journal_bytes"]) == stored
    assert stored <= CAP


async def scenario(url: str, ops: list) -> None:
    client = redis_async.Redis.from_url(url)
    store = SessionStore(client, KEYS)
    sid = f"duplex-{uuid.uuid4().hex}"
    model = Model()
    await store.open(sid, "worker-a", "echo", token_digest(model.token), "{}")
    created = PublishItem(b'{"type":"session.created","event_id":"e0"}', "session.created", False)
    await store.publish(sid, [created], max_bytes=CAP, ttl_ms=60_000, closed_ttl_ms=60_000)
    n = 0
    try:
        for op, arg in ops:
            if op == "publish":
                items = []
                for journaled, pad in arg:
                    n += 1
                    items.append(item(n, journaled, pad))
                seqs = await store.publish(
                    sid, items, max_bytes=CAP, ttl_ms=60_000, closed_ttl_ms=60_000
                )
                expected = []
                for journaled, _ in arg:
                    if journaled and not model.overflow:
                        model.head += 1
                        expected.append(model.head)
                    else:
                        expected.append(0)
                assert seqs == expected  # journaled events get the next seqs, in order
                entries = await journal_entries(client, sid, KEYS)
                oldest = entries[0].first_seq if entries else model.head + 1
                model.first = max(model.first, oldest)
            elif op == "ack":
                seq = max(0, model.head + arg)
                first = await store.ack(sid, seq)
                if seq > model.head:
                    assert first == -1  # an ack past the head is refused
                else:
                    model.first = max(model.first, seq + 1)
                    assert first == model.first
                    # whole entries go; one only partly acknowledged stays
                    entries = await journal_entries(client, sid, KEYS)
                    assert all(entry.last_seq > seq for entry in entries)
                    # a replay from the first seq still kept is whole, mid-entry or not
                    since = model.first - 1
                    replay = [r.seq for r in await store.journal_records(sid, since)]
                    assert replay == list(range(since + 1, model.head + 1))
            elif op == "detach":
                generation = model.attachment + arg
                result = await store.detach(sid, generation, 30_000)
                assert result == (1 if generation == model.attachment else 0)
            else:
                which, back = arg
                presented = {"current": model.token, "previous": model.previous}.get(which)
                presented = presented or "forged-" + uuid.uuid4().hex
                last = max(0, model.head - back)
                new_token = f"token-{model.attachment}"
                try:
                    reply = await store.resume(sid, presented, new_token, last)
                except SessionStoreError as exc:
                    assert presented != model.token
                    assert exc.code in ("invalid_resume_token", "session_resume_conflict")
                    continue
                assert presented == model.token  # only the current token resumes
                if last + 1 < model.first:
                    assert isinstance(reply, ResumeResync) and reply.reason == "journal_gap"
                    continue
                assert isinstance(reply, ResumeGranted)
                model.attachment += 1
                model.previous, model.token = model.token, new_token
                assert reply.attachment_generation == model.attachment
                assert reply.next_seq == model.head
            await check_invariants(client, store, sid, model)
    finally:
        await client.delete(KEYS.session(sid), KEYS.events(sid))
        await client.aclose()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=operations)
def test_journal_and_lease_scripts_keep_the_contract(redis_server, ops):
    asyncio.run(scenario(redis_server.url, ops))
