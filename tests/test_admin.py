"""`duplex sessions tail` as `tail -f` on the journal, against a real Redis, a Redis Cluster
and fakeredis: the latest events at once, nothing lost between two reads, a clear end."""

import asyncio
import io

import orjson
import pytest

from services.admin import Admin
from shared.redis.connection import RedisHandle
from shared.redis.keys import KeySchema
from shared.redis.store import ModelAppend, PublishItem, SessionStore, SessionWrite, token_digest

SID = "duplex-tail1"
KEYS = KeySchema()


def event(wire_type: str, n: int, **fields) -> PublishItem:
    body = {"type": wire_type, "event_id": f"event_{n:032x}", "n": n, **fields}
    return PublishItem(orjson.dumps(body), wire_type)


class Lines(io.StringIO):
    """stdout of the tail: a test waits for a line to be printed, not for time to pass."""

    def __init__(self) -> None:
        super().__init__()
        self.written = asyncio.Event()

    def write(self, text: str) -> int:
        self.written.set()
        return super().write(text)

    async def until(self, count: int) -> None:
        while len(self.getvalue().splitlines()) < count:
            self.written.clear()
            await self.written.wait()


class Tail:
    """An Admin writing to buffers, and the store that journals the session's events."""

    def __init__(self, client) -> None:
        self.client = client
        self.store = SessionStore(client, KEYS)
        self.out, self.err = Lines(), io.StringIO()
        self.admin = Admin(RedisHandle(client, "test"), KEYS, self.out, self.err)
        self.admin.block_ms = 20  # the tests wait on state, not on the block timeout

    async def open(self) -> None:
        await self.store.open(SID, "worker-a", "echo", token_digest("t"), "{}")

    async def publish(self, *items: PublishItem) -> list[int]:
        return await self.store.publish(
            SID, items, max_bytes=1 << 20, ttl_ms=60_000, closed_ttl_ms=60_000
        )

    def printed(self) -> list[dict]:
        return [orjson.loads(line) for line in self.out.getvalue().splitlines()]

    async def run(self, *args, **kwargs) -> int:
        async with asyncio.timeout(10):  # a tail that misses an event would wait forever
            return await self.admin.tail(SID, *args, **kwargs)


@pytest.fixture
async def tail(redis_client):
    t = Tail(redis_client)
    await t.open()
    return t


async def test_the_latest_events_of_an_idle_session_are_printed_at_once(tail):
    await tail.publish(*(event("session.heartbeat_ack", n) for n in range(1, 15)))
    assert await tail.run(3, limit=3) == 0
    assert [e["n"] for e in tail.printed()] == [12, 13, 14]
    assert [e["server_event_seq"] for e in tail.printed()] == [12, 13, 14]


async def test_an_event_journaled_between_two_reads_is_printed(tail):
    """The race that lost events: a read comes back empty, an event is journaled, the next
    read starts. It must start after the last entry printed, not at `$` (the newest)."""
    await tail.publish(event("session.heartbeat_ack", 1))
    real_xread = tail.client.xread
    empty_reads = []

    async def xread(streams, **options):
        reply = await real_xread(streams, **options)
        if not reply and not empty_reads:
            empty_reads.append(streams)
            await tail.publish(event("session.heartbeat_ack", 2))  # before the next read
        return reply

    tail.client.xread = xread
    assert await tail.run(1, limit=2) == 0
    assert empty_reads and [e["n"] for e in tail.printed()] == [1, 2]


async def test_a_burst_is_followed_without_a_gap(tail):
    await tail.publish(event("session.heartbeat_ack", 0))
    following = asyncio.create_task(tail.run(1, limit=201))
    await tail.out.until(1)  # following now
    for start in range(1, 201, 20):  # bursts of 20 events per publish round
        await tail.publish(
            *(event("response.output_audio.delta", n) for n in range(start, start + 20))
        )
    assert await following == 0
    assert [e["n"] for e in tail.printed()] == list(range(201))


async def test_an_empty_journal_is_followed_from_its_first_event(tail):
    following = asyncio.create_task(tail.run(10, limit=1))
    await tail.publish(event("session.heartbeat_ack", 1))
    assert await following == 0 and [e["n"] for e in tail.printed()] == [1]


async def test_it_ends_when_the_session_closes(tail):
    await tail.publish(event("session.heartbeat_ack", 1))
    following = asyncio.create_task(tail.run(1))
    await tail.out.until(1)
    await tail.publish(event("session.closed", 2, reason="maintenance"))
    assert await following == 0
    assert [e["type"] for e in tail.printed()] == ["session.heartbeat_ack", "session.closed"]
    assert tail.err.getvalue() == f"session {SID} closed (maintenance)\n"


async def test_a_closed_session_prints_its_last_events_and_ends(tail):
    await tail.publish(event("session.heartbeat_ack", 1), event("session.closed", 2))
    assert await tail.run(5) == 0
    assert [e["n"] for e in tail.printed()] == [1, 2]
    assert "closed" in tail.err.getvalue()


async def test_an_unknown_or_vanished_session_is_an_error(tail):
    assert await tail.admin.tail("duplex-nope") == 1
    assert tail.err.getvalue() == "no session duplex-nope\n"
    await tail.publish(event("session.heartbeat_ack", 1))
    following = asyncio.create_task(tail.run(1))
    await tail.out.until(1)
    await tail.client.delete(KEYS.session(SID), KEYS.events(SID))  # expired from Redis
    assert await following == 1
    assert tail.err.getvalue().endswith(f"session {SID} is gone (expired from Redis)\n")
    assert [e["n"] for e in tail.printed()] == [1]


async def test_a_journal_overflow_ends_it_with_an_error(tail):
    await tail.publish(event("session.heartbeat_ack", 1))
    following = asyncio.create_task(tail.run(1))
    await tail.out.until(1)
    huge = event("response.output_audio.delta", 2, delta="x" * 2000)
    await tail.store.publish(SID, [huge], max_bytes=1000, ttl_ms=60_000, closed_ttl_ms=60_000)
    assert (await tail.store.meta(SID))["journal_overflow"] == "1"
    assert await following == 1
    assert tail.err.getvalue() == f"session {SID}: its journal overflowed, nothing to follow\n"


async def test_limit_counts_the_events_printed_at_once(tail):
    await tail.publish(*(event("session.heartbeat_ack", n) for n in range(1, 6)))
    assert await tail.run(10, limit=2) == 0
    assert [e["n"] for e in tail.printed()] == [1, 2]


async def test_the_latest_events_are_counted_in_events_not_in_rounds(tail):
    # the journal holds one entry per publisher round: 1-4, 5-6, then 7-9 while following
    await tail.publish(*(event("session.heartbeat_ack", n) for n in range(1, 5)))
    await tail.publish(event("session.heartbeat_ack", 5), event("session.heartbeat_ack", 6))
    following = asyncio.create_task(tail.run(3, limit=6))
    await tail.out.until(3)
    await tail.publish(*(event("response.output_audio.delta", n) for n in range(7, 10)))
    assert await following == 0
    assert [e["n"] for e in tail.printed()] == [4, 5, 6, 7, 8, 9]
    assert [e["server_event_seq"] for e in tail.printed()] == [4, 5, 6, 7, 8, 9]


async def test_show_prints_the_last_events_from_the_middle_of_a_round(tail):
    await tail.publish(*(event("session.heartbeat_ack", n) for n in range(1, 5)))
    await tail.publish(event("session.heartbeat_ack", 5))
    assert await tail.admin.show(SID, last=3) == 0
    lines = tail.out.getvalue().splitlines()
    marker = lines.index("-- last 3 events (journal from seq 3)")
    shown = [line.split(maxsplit=1) for line in lines[marker + 1 :]]
    assert [int(seq) for seq, _ in shown] == [3, 4, 5]
    assert [orjson.loads(data)["n"] for _, data in shown] == [3, 4, 5]


async def test_show_names_a_native_sessions_model_history(tail):
    """`duplex sessions show` says where the model history is and how many frames it holds
    (what a restore would replay)."""
    await tail.store.publish_many(
        [SessionWrite(SID, [], model_append=ModelAppend(0, bytes(34 * 5), 34))],
        max_bytes=1 << 20,
        ttl_ms=60_000,
        closed_ttl_ms=60_000,
    )
    assert await tail.admin.show(SID) == 0
    lines = tail.out.getvalue().splitlines()
    assert f"-- model history {KEYS.model_history(SID)}: 170 bytes, 5 frames" in lines


async def test_show_says_how_far_a_restore_is(tail):
    """A native session being restored: its worker writes the progress to the hash
    (`restore`, only while it owns the session), and `show` says it for people."""
    store = tail.store
    meta = await store.meta(SID)
    generation = int(meta["owner_generation"])
    progress = {"frames": 250, "replayed": 100, "seconds": 0.5, "pace": 16.0, "done": False}
    written = await store.write_restore_progress(
        [(SID, generation, orjson.dumps(progress)), (SID, generation + 1, b"{}")]
    )
    assert written == [True, False]  # another generation's writer is fenced out
    assert await tail.admin.show(SID) == 0
    lines = tail.out.getvalue().splitlines()
    replaying = "replaying: 100 of 250 frames (40%) in 0.50 s, 16.0x real time so far"
    assert f"-- restore: {replaying}" in lines
    progress.update(replayed=250, seconds=1.25, pace=16.0, done=True)
    await store.write_restore_progress([(SID, generation, orjson.dumps(progress))])
    tail.out.truncate(0)
    tail.out.seek(0)
    assert await tail.admin.show(SID) == 0
    lines = tail.out.getvalue().splitlines()
    assert "-- restore: done: 250 frames replayed in 1.25 s (16.0x real time)" in lines
    # a session that is gone is never recreated by a late report
    assert await store.write_restore_progress([("duplex-gone", 1, b"{}")]) == [False]
    assert not await tail.client.exists(KEYS.session("duplex-gone"))


async def test_ls_and_show_say_which_protocol_a_session_was_opened_on(redis_client):
    store = SessionStore(redis_client, KEYS)
    for sid, surface in (("duplex-s1", None), ("duplex-s2", "moshi"), ("duplex-s3", "live")):
        config = {"model": "m"} | ({"duplex_surface": surface} if surface else {})
        await store.open(sid, "w", "m", "", orjson.dumps(config).decode())
    out = io.StringIO()
    admin = Admin(RedisHandle(redis_client, "test"), KEYS, out, io.StringIO())
    await admin.ls(as_json=True)
    rows = {row["session_id"]: row for row in map(orjson.loads, out.getvalue().splitlines())}
    assert {sid: rows[sid]["surface"] for sid in ("duplex-s1", "duplex-s2", "duplex-s3")} == {
        "duplex-s1": "duplex",
        "duplex-s2": "moshi",
        "duplex-s3": "live",
    }
    table = io.StringIO()
    admin.out = table
    await admin.ls(as_json=False)
    header, *lines = table.getvalue().splitlines()
    assert "SURFACE" in header
    assert any(line.startswith("duplex-s2") and " moshi " in line for line in lines)
    shown = io.StringIO()
    admin.out = shown
    assert await admin.show("duplex-s3") == 0
    assert "surface                  live" in shown.getvalue().splitlines()


async def test_a_record_of_bytes_is_printed_as_its_type_and_size(tail):
    """A moshi session's audio crosses Redis as its pcm16 bytes, not JSON: tail says what
    and how much instead of printing them."""
    pcm = bytes(range(256)) * 15  # not UTF-8, not JSON
    await tail.publish(event("session.heartbeat_ack", 1), PublishItem(pcm, "moshi.audio"))
    assert await tail.run(2, limit=2) == 0
    assert tail.printed()[1] == {"type": "moshi.audio", "bytes": 3840}
