"""WorkerClient (services/api/worker_client.py): the entries the API pod writes to a worker's
inbox stream, field for field, in order, and which of them the inbox's budget may refuse."""

import fakeredis
import orjson
import pytest

from services.api.inbox_writer import InboxFull, InboxWriter
from services.api.worker_client import UNBUDGETED, WorkerClient
from shared.protocol.duplex import AppendAudio, CloseSession, Heartbeat, parse_client_event
from shared.redis.boundary import MIN_ENTRY_BYTES, CommandRecord, InboxMessage, entry_bytes
from tests.api.parts import KEYS, inbox

#: fields a command needs to parse
EXTRA = {"playback.ack": {"played_ms": 0}}


def command_type(fields: dict[bytes, bytes]) -> str | None:
    """The type of the command an entry carries (None: not a command)."""
    record = InboxMessage.from_fields(fields).record()
    return record.command_type if isinstance(record, CommandRecord) else None


@pytest.fixture
async def client():
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()


async def test_every_kind_of_entry_with_its_fields_in_order(client):
    writer = InboxWriter(client, KEYS)
    workers = WorkerClient(writer)
    await workers.open("w1", "duplex-s", {"model": "echo"})
    await workers.command("w1", "duplex-s", 3, 7, Heartbeat(event_id="hb"))
    await workers.touch("w1", "duplex-s", 3)
    await workers.close("w1", "duplex-s", 3, "disconnect")
    await workers.chat("w1", "req-1", [{"role": "user", "content": "hi"}])
    await workers.stop()
    assert await inbox(client, "w1") == [
        {
            b"k": b"open",
            b"s": b"duplex-s",
            b"a": b"1",
            b"q": b"0",
            b"p": b'{"session":{"model":"echo"}}',
        },
        {
            b"k": b"command",
            b"s": b"duplex-s",
            b"a": b"3",
            b"q": b"7",
            b"p": b'{"type":"session.heartbeat","event_id":"hb"}',
        },
        {b"k": b"touch", b"s": b"duplex-s", b"a": b"3", b"q": b"0", b"p": b"{}"},
        {
            b"k": b"close",
            b"s": b"duplex-s",
            b"a": b"3",
            b"q": b"0",
            b"p": b'{"reason":"disconnect"}',
        },
        {
            b"k": b"chat",
            b"s": b"req-1",
            b"a": b"0",
            b"q": b"0",
            b"p": b'{"messages":[{"role":"user","content":"hi"}]}',
        },
    ]
    # each entry is counted in the inbox's budget, at least MIN_ENTRY_BYTES
    assert int(await client.get(KEYS.inbox_bytes("w1"))) == 5 * MIN_ENTRY_BYTES


async def test_an_append_travels_with_its_audio_raw_beside_the_payload(client):
    workers = WorkerClient(InboxWriter(client, KEYS))
    audio = b"\x01\x00" * 400
    await workers.command("w1", "duplex-s", 1, 1, AppendAudio(audio=audio, event_id="a1"))
    await workers.stop()
    [fields] = await inbox(client, "w1")
    assert fields[b"k"] == b"command" and fields[b"q"] == b"1"
    assert fields[b"b"] == audio
    # its validated fields (AppendAudio.inbox_fields), no base64 copy of the audio
    assert orjson.loads(fields[b"p"]) == ["a1", "pcm16", 16000]
    assert int(await client.get(KEYS.inbox_bytes("w1"))) == len(fields[b"p"]) + len(audio)


async def test_a_full_inbox_refuses_appends_but_never_what_keeps_a_session_alive(client):
    append = AppendAudio(audio=b"\x00" * 2000, event_id="a1")
    size = entry_bytes(CommandRecord("duplex-s", 1, 1, append).to_fields())
    workers = WorkerClient(InboxWriter(client, KEYS, max_bytes=size))
    await workers.command("w1", "duplex-s", 1, 1, append)  # fills the budget exactly
    with pytest.raises(InboxFull):
        await workers.command("w1", "duplex-s", 1, 2, AppendAudio(audio=b"\x00", event_id="a2"))
    with pytest.raises(InboxFull):  # chat requests count like commands
        await workers.chat("w1", "req-1", [])
    for seq, wire_type in enumerate(sorted(UNBUDGETED), start=3):
        command = parse_client_event({"type": wire_type, **EXTRA.get(wire_type, {})})
        await workers.command("w1", "duplex-s", 1, seq, command)
    await workers.command("w1", "duplex-s", 1, 20, CloseSession())
    await workers.open("w1", "duplex-t", {})
    await workers.touch("w1", "duplex-s", 1)
    await workers.close("w1", "duplex-s", 1, "output_overflow")
    await workers.stop()
    entries = await inbox(client, "w1")
    kinds = [(f[b"k"], command_type(f), int(f[b"q"])) for f in entries]
    assert kinds == [
        (b"command", "input_audio_buffer.append", 1),  # a2 and the chat were never written
        *[(b"command", t, s) for s, t in enumerate(sorted(UNBUDGETED), start=3)],
        (b"command", "session.close", 20),
        (b"open", None, 0),
        (b"touch", None, 0),
        (b"close", None, 0),
    ]
