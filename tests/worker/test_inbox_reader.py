"""Issue 18, the worker side (services/worker/inbox_reader.py): entries of many messages are
decoded once and each session gets its typed commands in order, across entries; an entry
read but never acknowledged is dispatched once after a restart; entries no API pod wrote are
refused whole; a draining worker's drain takes the typed messages of moved sessions; acks
leave in batches and the byte counter is healed only when asked."""

import asyncio
import collections

import pytest

from services.api.inbox_writer import CommandSeq, InboxWriter
from services.api.worker_client import WorkerClient
from services.worker.inbox_reader import InboxReader
from shared.protocol.duplex import AppendAudio, Commit, Heartbeat
from shared.redis.boundary import (
    FORWARDED_KINDS,
    CloseRequest,
    CommandRecord,
    InboxMessage,
    UnknownCommand,
    decode_entry,
    encode_entry,
)
from shared.redis.keys import INBOX_GROUP, KeySchema
from shared.redis.store import SessionStore

KEYS = KeySchema()


def append(n: int) -> AppendAudio:
    return AppendAudio(audio=bytes([n % 256]) * 640, event_id=f"a{n}")


class Reader:
    """An InboxReader whose dispatch records what the worker's would receive."""

    def __init__(self, client, worker: str = "w") -> None:
        handle = type(
            "Handle",
            (),
            {
                "client": client,
                "new_client": lambda self: client,
                "reader_client": lambda self: client,
            },
        )()
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
    entries = await redis_client.xrange(KEYS.inbox("w"))
    assert any(len(decode_entry(fields)) > 1 for _, fields in entries)  # they shared entries
    reader = Reader(redis_client)
    reader.reader.read_from = ">"
    await reader.run_until(6 * 36)
    by_session = collections.defaultdict(list)
    for record in reader.seen:
        assert isinstance(record, CommandRecord)  # typed as decoded
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
    messages = [CommandRecord(f"duplex-{n % 3}", 1, n // 3 + 1, append(n)) for n in range(9)]
    await redis_client.xadd(inbox, encode_entry(messages[:5]))
    await redis_client.xadd(inbox, encode_entry(messages[5:]))
    # a process read both packs and died before acknowledging either
    await redis_client.xreadgroup(INBOX_GROUP, "w", {inbox: ">"}, count=10)
    reader = Reader(redis_client)
    await reader.run_until(9)
    # past its pending entries: a second read from "0" would have dispatched them again
    assert reader.reader.read_from == ">"
    assert reader.seen == messages
    await reader.reader.ack_pending()
    assert await redis_client.xlen(inbox) == 0
    assert (await redis_client.xpending(inbox, INBOX_GROUP))["pending"] == 0


GOOD = encode_entry([CommandRecord("duplex-g", 1, 1, AppendAudio(audio=b"\x01\x00", event_id="g"))])
GOOD_M = GOOD["m"]


@pytest.mark.parametrize(
    "fields",
    [
        {"m": b"not json"},
        {"m": b'{"a": 1}'},
        {"m": b'[["command", "duplex-x", 1, 1, {}]]'},  # the old headers
        {"m": GOOD_M.replace(b'"a":1', b'"a":"1"'), "b0": GOOD["b0"]},  # a wrong type
        {"m": GOOD_M.replace(b'"s":"duplex-g"', b'"s":5'), "b0": GOOD["b0"]},
        {"m": GOOD_M.replace(b'"k":"command"', b'"k":"teleport"'), "b0": GOOD["b0"]},
        {"m": GOOD_M},  # an append without its audio field
        {"k": "pack"},  # no messages
    ],
    ids=["json", "object", "old", "type", "session", "tag", "audio", "no-m"],
)
async def test_garbage_entries_are_refused_whole_and_acknowledged(redis_client, fields):
    inbox = KEYS.inbox("w")
    await redis_client.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    await redis_client.xadd(inbox, fields)
    good = CommandRecord("duplex-y", 1, 1, Heartbeat(event_id="h"))
    await redis_client.xadd(inbox, encode_entry([good, good]))
    reader = Reader(redis_client)
    reader.reader.read_from = ">"
    await reader.run_until(2)
    assert reader.seen == [good, good]  # nothing of the garbage was dispatched
    await reader.reader.ack_pending()
    assert await redis_client.xlen(inbox) == 0


@pytest.mark.parametrize(
    "body", [b"[1]", b'["e1"]', b'{"event_id": "e1", "sample_rate_hz": "16000"}', b'{"hints": []}']
)
def test_an_append_body_no_api_pod_wrote_is_refused(body):
    m = b'[{"k":"command","s":"duplex-x","a":1,"q":1,"c":["input_audio_buffer.append",%s]}]'
    with pytest.raises(ValueError):
        decode_entry({b"m": m % body, b"b0": b"\x00\x00"})


async def test_a_command_of_an_unknown_type_is_dispatched_alone_to_be_refused(redis_client):
    """A newer API pod's command reaches dispatch as an UnknownCommand (the worker answers
    unknown_event); the other messages of its entry are dispatched as usual."""
    inbox = KEYS.inbox("w")
    await redis_client.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    good = CommandRecord("duplex-y", 1, 2, Heartbeat(event_id="h"))
    fields = encode_entry([good])
    unknown = b'{"k":"command","s":"duplex-y","a":1,"q":1,"c":["input.telepathy",{"event_id":"t"}]}'
    fields["m"] = b"[" + unknown + b"," + fields["m"][1:]
    await redis_client.xadd(inbox, fields)
    reader = Reader(redis_client)
    reader.reader.read_from = ">"
    await reader.run_until(2)
    first, second = reader.seen
    assert isinstance(first, UnknownCommand) and first.event_id == "t"
    assert second == good


async def test_batched_acks_heal_the_counter_only_when_asked(redis_client):
    store = SessionStore(redis_client, KEYS)
    inbox, counter = KEYS.inbox("w"), KEYS.inbox_bytes("w")
    await redis_client.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    message = CommandRecord("duplex-a", 1, 1, append(1))
    await redis_client.xadd(inbox, encode_entry([message, message]))
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
        self.taken: list[InboxMessage] = []
        self.rounds = 0

    def read_round(self, stripe: int = 0) -> None:
        self.rounds += 1

    async def take(self, message: InboxMessage) -> bool:
        if message.session_id != self.moved:
            return False
        self.taken.append(message)
        return True


async def test_a_draining_worker_takes_the_typed_messages_of_a_moved_session(redis_client):
    inbox = KEYS.inbox("w")
    await redis_client.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    messages = [
        CommandRecord(sid, 1, seq, append(seq))
        for seq in (1, 2)
        for sid in ("duplex-moved", "duplex-kept")
    ]
    await redis_client.xadd(inbox, encode_entry(messages))
    reader = Reader(redis_client)
    drain = RecordingDrain("duplex-moved")
    reader.reader.drain = lambda: drain
    reader.reader.read_from = ">"
    await reader.run_until(2)
    assert [m.session_id for m in reader.seen] == ["duplex-kept"] * 2
    # the drain gets the messages as decoded (no fields, no second decode): forwarded,
    # they are written anew for the new worker (`SessionStore.inbox_forward`)
    assert drain.taken == [m for m in messages if m.session_id == "duplex-moved"]
    assert all(isinstance(m, FORWARDED_KINDS) for m in drain.taken)
    assert drain.rounds >= 1


async def test_forwarded_messages_reach_the_new_worker_as_read(redis_client):
    """What a drain or the dead-worker sweep forwards: the same typed messages, marks and
    audio included, in order, in as few entries as the limits allow."""
    store = SessionStore(redis_client, KEYS)
    messages = [CommandRecord("duplex-m", 1, seq, append(seq)) for seq in range(1, 6)]
    messages.append(CloseRequest("duplex-m", "client_close", 1))
    await store.inbox_forward("w2", "duplex-m", messages, max_messages=4)
    entries = await redis_client.xrange(KEYS.inbox("w2"))
    assert [len(decode_entry(fields)) for _, fields in entries] == [4, 2]
    assert [m for _, fields in entries for m in decode_entry(fields)] == messages
    await store.inbox_forward("w3", "duplex-m", messages, max_audio=2 * 640)
    entries = await redis_client.xrange(KEYS.inbox("w3"))
    assert [len(decode_entry(fields)) for _, fields in entries] == [2, 2, 2]
    await store.inbox_forward("w4", "duplex-m", [])
    assert await redis_client.xlen(KEYS.inbox("w4")) == 0


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


async def test_a_worker_answers_an_unknown_command_with_unknown_event_and_goes_on():
    """Through a real worker: a newer API pod's command gets `unknown_event` (with its
    event_id) on its session, and the next message of the same entry is handled."""
    import orjson

    from services.worker.process import WorkerProcess
    from shared.redis.boundary import OpenRequest
    from shared.redis.connection import connect
    from shared.redis.live_message import split
    from shared.settings import WorkerSettings

    handle = connect(None)
    worker = WorkerProcess(WorkerSettings(worker_id="w-u", max_sessions=1), handle)
    client, sid = handle.client, "duplex-u"
    await worker.start()
    try:
        await SessionStore(client, KEYS).open(sid, "w-u", "echo", "", "{}")
        pubsub = handle.new_client().pubsub()
        await pubsub.subscribe(KEYS.live(sid))
        await client.xadd(KEYS.inbox("w-u"), OpenRequest(sid, {}).to_fields())
        fields = encode_entry([CommandRecord(sid, 1, 2, Heartbeat(event_id="h2"))])
        unknown = b'{"k":"command","s":"duplex-u","a":1,"q":1,"c":["input.x",{"event_id":"x1"}]}'
        fields["m"] = b"[" + unknown + b"," + fields["m"][1:]
        await client.xadd(KEYS.inbox("w-u"), fields)
        received: list[dict] = []
        async with asyncio.timeout(10):
            while not received or received[-1]["type"] != "session.heartbeat_ack":
                message = await pubsub.get_message(timeout=1)
                if message and message["type"] == "message":
                    data = message["data"]
                    if data.startswith(b"{"):
                        received.append(orjson.loads(data))
                    else:
                        received += [orjson.loads(r.data) for r in split(data)]
        [error] = [event for event in received if event["type"] == "error"]
        assert (error["error"]["code"], error["error"]["event_id"]) == ("unknown_event", "x1")
        await pubsub.aclose()
    finally:
        await worker.stop()
