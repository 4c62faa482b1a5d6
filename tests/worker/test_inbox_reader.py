"""Issue 18, the worker side (services/worker/inbox_reader.py): packed entries are unpacked and
each session gets its commands in order, across entries; a pack read but never acknowledged
is dispatched once after a restart; entries no API pod wrote are refused whole; acks leave in
batches and the byte counter is healed only when asked."""

import asyncio
import collections

import pytest

from services.api.inbox_writer import CommandSeq, InboxWriter
from services.api.worker_client import WorkerClient
from services.worker.inbox_reader import InboxReader
from shared.protocol.duplex import AppendAudio, Commit, Heartbeat
from shared.redis.boundary import (
    FORWARDED_KINDS,
    PACK,
    CloseRequest,
    CommandRecord,
    InboxMessage,
    pack_entry,
)
from shared.redis.keys import INBOX_GROUP, KeySchema
from shared.redis.store import SessionStore

KEYS = KeySchema()


def append(n: int) -> AppendAudio:
    return AppendAudio(audio=bytes([n % 256]) * 640, event_id=f"a{n}")


class Reader:
    """An InboxReader whose dispatch records what the worker's would receive."""

    def __init__(self, client, worker: str = "w") -> None:
        handle = type("Handle", (), {"client": client, "new_client": lambda self: client})()
        self.seen: list[InboxMessage] = []
        self.reader = InboxReader(
            handle,
            SessionStore(client, KEYS),
            worker,
            KEYS.inbox(worker),
            self._dispatch,
            lambda: None,
            ack_interval_s=0.01,
        )
        self.reader.block_ms = 50

    async def _dispatch(self, message: InboxMessage) -> None:
        self.seen.append(message)

    async def run_until(self, count: int) -> None:
        task = asyncio.create_task(self.reader.consume())
        try:
            async with asyncio.timeout(10):
                while len(self.seen) < count or self.reader.read_from != ">":
                    await asyncio.sleep(0.005)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_many_sessions_commands_reach_the_worker_in_order_through_packs(redis_client):
    await redis_client.xgroup_create(KEYS.inbox("w"), INBOX_GROUP, id="0", mkstream=True)
    writer = InboxWriter(redis_client, KEYS, linger_s=0.01)
    workers = WorkerClient(writer)
    sessions = [f"duplex-{i}" for i in range(6)]
    seqs = {sid: CommandSeq() for sid in sessions}

    async def session(sid: str) -> None:
        pending = []
        for turn in range(4):
            for n in range(8):
                event = append(turn * 10 + n)
                pending.append(workers.send_command("w", sid, 1, seqs[sid], event))
            await workers.command("w", sid, 1, seqs[sid], Commit(event_id=f"c{turn}"))
        await asyncio.gather(*pending)

    await asyncio.gather(*(session(sid) for sid in sessions))
    await writer.stop()
    packs = [f for _, f in await redis_client.xrange(KEYS.inbox("w")) if f[b"k"] == b"pack"]
    assert packs  # the sessions' commands shared entries
    reader = Reader(redis_client)
    reader.reader.read_from = ">"
    await reader.run_until(6 * 36)
    by_session = collections.defaultdict(list)
    for message in reader.seen:
        record = message.record()
        by_session[record.session_id].append((record.seq, record.command.event_id))
    for sid in sessions:
        expected = []
        for turn in range(4):
            expected += [f"a{turn * 10 + n}" for n in range(8)] + [f"c{turn}"]
        assert by_session[sid] == list(enumerate(expected, start=1))
    await reader.reader.ack_pending()
    assert await redis_client.xlen(KEYS.inbox("w")) == 0
    assert int(await redis_client.get(KEYS.inbox_bytes("w"))) == 0  # every byte given back


async def test_a_redelivered_pack_is_dispatched_once_in_order(redis_client):
    inbox = KEYS.inbox("w")
    await redis_client.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    messages = [
        CommandRecord(f"duplex-{n % 3}", 1, n // 3 + 1, append(n)).to_message() for n in range(9)
    ]
    await redis_client.xadd(inbox, pack_entry(messages[:5]))
    await redis_client.xadd(inbox, pack_entry(messages[5:]))
    # a process read both packs and died before acknowledging either
    await redis_client.xreadgroup(INBOX_GROUP, "w", {inbox: ">"}, count=10)
    reader = Reader(redis_client)
    await reader.run_until(9)
    # past its pending entries: a second read from "0" would have dispatched them again
    assert reader.reader.read_from == ">"
    assert [m.record() for m in reader.seen] == [m.record() for m in messages]
    await reader.reader.ack_pending()
    assert await redis_client.xlen(inbox) == 0
    assert (await redis_client.xpending(inbox, INBOX_GROUP))["pending"] == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"k": PACK, "m": b"not json"},
        {"k": PACK, "m": b'{"a": 1}'},
        {"k": PACK, "m": b'[["command", "duplex-x", 1]]'},
        {"k": PACK, "m": b'[["command", 5, 1, 1, {}]]'},
        {"k": PACK, "m": b'[["command", "duplex-x", "1", 1, {}]]'},
        {"k": PACK},
    ],
)
async def test_garbage_packs_are_refused_whole_and_acknowledged(redis_client, fields):
    inbox = KEYS.inbox("w")
    await redis_client.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    await redis_client.xadd(inbox, fields)
    good = CommandRecord("duplex-y", 1, 1, Heartbeat(event_id="h")).to_message()
    await redis_client.xadd(inbox, pack_entry([good, good]))
    reader = Reader(redis_client)
    reader.reader.read_from = ">"
    await reader.run_until(2)
    assert reader.seen == [good, good]  # nothing of the garbage was dispatched
    await reader.reader.ack_pending()
    assert await redis_client.xlen(inbox) == 0


@pytest.mark.parametrize(
    "payload", [b"[1]", b'["e1"]', b'["e1", "pcm16", 16000, null, null, null, [], {}, 9]']
)
def test_an_append_field_form_no_api_pod_wrote_is_refused(payload):
    fields = {b"k": b"command", b"s": b"duplex-x", b"a": b"1", b"q": b"1", b"p": payload}
    with pytest.raises((ValueError, TypeError)):
        InboxMessage.from_fields(fields).record()


async def test_batched_acks_heal_the_counter_only_when_asked(redis_client):
    store = SessionStore(redis_client, KEYS)
    inbox, counter = KEYS.inbox("w"), KEYS.inbox_bytes("w")
    await redis_client.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    message = CommandRecord("duplex-a", 1, 1, append(1)).to_message()
    await redis_client.xadd(inbox, pack_entry([message, message]))
    await redis_client.set(counter, 10**6)  # drifted: a sweep deleted the stream, say
    [(_, [(entry_id, _)])] = await redis_client.xreadgroup(INBOX_GROUP, "w", {inbox: ">"})
    assert await store.inbox_ack("w", [(entry_id, 2000)], check_empty=False) == 1
    assert int(await redis_client.get(counter)) == 10**6 - 2000  # no XLEN on a batch
    assert await store.inbox_ack("w", [], check_empty=True) == 0  # the inbox went quiet
    assert int(await redis_client.get(counter)) == 0
    await redis_client.set(counter, 100)
    await redis_client.xadd(inbox, message.to_fields())
    [(_, [(entry_id, _)])] = await redis_client.xreadgroup(INBOX_GROUP, "w", {inbox: ">"})
    await store.inbox_ack("w", [(entry_id, 640)], check_empty=False)
    assert int(await redis_client.get(counter)) == 0  # below 0 it can only be wrong


class RecordingDrain:
    """A drain that keeps back every message of `moved` (as the real one forwards them)."""

    def __init__(self, moved: str) -> None:
        self.moved = moved
        self.taken: list[dict] = []
        self.rounds = 0

    def read_round(self) -> None:
        self.rounds += 1

    async def take(self, fields) -> bool:
        if fields[b"s"].decode() != self.moved:
            return False
        self.taken.append(fields)
        return True


async def test_a_draining_worker_forwards_a_packs_messages_one_entry_each(redis_client):
    inbox = KEYS.inbox("w")
    await redis_client.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    messages = [
        CommandRecord(sid, 1, seq, append(seq)).to_message()
        for seq in (1, 2)
        for sid in ("duplex-moved", "duplex-kept")
    ]
    await redis_client.xadd(inbox, pack_entry(messages))
    reader = Reader(redis_client)
    drain = RecordingDrain("duplex-moved")
    reader.reader.drain = lambda: drain
    reader.reader.read_from = ">"
    await reader.run_until(2)
    assert [m.session_id for m in reader.seen] == ["duplex-kept"] * 2
    # each forwarded message is an ordinary entry's fields, as read: the new worker (and
    # the drain's kind filter, bytes against bytes) reads it like any other
    assert all(fields[b"k"] in FORWARDED_KINDS for fields in drain.taken)
    forwarded = [InboxMessage.from_fields(fields) for fields in drain.taken]
    assert forwarded == [m for m in messages if m.session_id == "duplex-moved"]
    assert drain.rounds >= 1


async def test_a_loop_cancelled_mid_read_acknowledges_the_entries_it_dispatched(redis_client):
    """A stop cancels the consume loop wherever it is: the entries of the read it had
    dispatched are acknowledged by the stop's last ack, not dispatched again by the next
    process (an open, a close or a chat is not deduplicated by seq)."""
    inbox = KEYS.inbox("w")
    await redis_client.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    sessions = ["duplex-1", "duplex-2", "duplex-3"]
    for sid in sessions:
        await redis_client.xadd(inbox, CloseRequest(sid, "client_close").to_fields())
    reader = Reader(redis_client)
    reader.reader.read_from = ">"
    second = asyncio.Event()

    async def stuck_on_the_second(message: InboxMessage) -> None:
        reader.seen.append(message)
        if len(reader.seen) == 2:
            second.set()
            await asyncio.Event().wait()  # handling it when the stop comes

    reader.reader.dispatch = stuck_on_the_second
    task = asyncio.create_task(reader.reader.consume())
    async with asyncio.timeout(10):
        await second.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    [(first_id, _)] = await redis_client.xrange(inbox, count=1)
    assert [entry_id for entry_id, _ in reader.reader.unacked] == [first_id]
    await reader.reader.ack_pending(check_empty=True)  # what the worker's stop does

    again = Reader(redis_client)  # the next process: its pending entries first ("0")
    await again.run_until(2)
    assert [m.session_id for m in again.seen] == sessions[1:]
