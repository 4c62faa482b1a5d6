"""WorkerClient (services/api/worker_client.py): the entries the API pod writes to a worker's
inbox stream, field for field, in order, and which of them the inbox's budget may refuse."""

import fakeredis
import orjson
import pytest

from services.api.inbox_writer import InboxFull, InboxWriter
from services.api.worker_client import UNBUDGETED, WorkerClient
from shared.protocol.duplex import AppendAudio, CloseSession, Heartbeat, parse_client_event
from shared.redis.boundary import MIN_ENTRY_BYTES, CommandRecord, decode_entry, entry_bytes
from tests.api.parts import KEYS

#: fields a command needs to parse
EXTRA = {"playback.ack": {"played_ms": 0}}


async def inbox(client, worker_id: str) -> list[dict[bytes, bytes]]:
    """The worker's inbox entries as Redis holds them."""
    return [fields for _, fields in await client.xrange(KEYS.inbox(worker_id))]


def command_type(fields: dict[bytes, bytes]) -> str | None:
    """The type of the command an entry carries (None: not a command)."""
    [record] = decode_entry(fields)
    return record.command_type if isinstance(record, CommandRecord) else None


def kind(fields: dict[bytes, bytes]) -> str:
    """The tag of the one message an entry carries."""
    [message] = orjson.loads(fields[b"m"])
    return message["k"]


def seq_of(fields: dict[bytes, bytes]) -> int:
    [record] = decode_entry(fields)
    return record.seq if isinstance(record, CommandRecord) else 0


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
    assert [orjson.loads(fields[b"m"]) for fields in await inbox(client, "w1")] == [
        [{"k": "open", "s": "duplex-s", "session": {"model": "echo"}, "a": 1}],
        [
            {
                "k": "command",
                "s": "duplex-s",
                "a": 3,
                "q": 7,
                "c": ["session.heartbeat", {"event_id": "hb"}],
            }
        ],
        [{"k": "touch", "s": "duplex-s", "a": 3}],
        [{"k": "close", "s": "duplex-s", "reason": "disconnect", "a": 3}],
        [{"k": "chat", "s": "req-1", "messages": [{"role": "user", "content": "hi"}]}],
    ]
    # each entry is counted in the inbox's budget, at least MIN_ENTRY_BYTES
    assert int(await client.get(KEYS.inbox_bytes("w1"))) == 5 * MIN_ENTRY_BYTES


async def test_an_append_travels_with_its_audio_raw_beside_the_payload(client):
    workers = WorkerClient(InboxWriter(client, KEYS))
    audio = b"\x01\x00" * 400
    await workers.command("w1", "duplex-s", 1, 1, AppendAudio(audio=audio, event_id="a1"))
    await workers.stop()
    [fields] = await inbox(client, "w1")
    [message] = orjson.loads(fields[b"m"])
    assert (message["k"], message["q"]) == ("command", 1)
    assert fields[b"b0"] == audio
    # its validated fields (AppendAudio.inbox_fields), no base64 copy of the audio
    body = {"event_id": "a1", "format": "pcm16", "sample_rate_hz": 16000}
    assert message["c"] == ["input_audio_buffer.append", body]
    assert int(await client.get(KEYS.inbox_bytes("w1"))) == len(fields[b"m"]) + len(audio)


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
    kinds = [(kind(f), command_type(f), seq_of(f)) for f in entries]
    assert kinds == [
        ("command", "input_audio_buffer.append", 1),  # a2 and the chat were never written
        *[("command", t, s) for s, t in enumerate(sorted(UNBUDGETED), start=3)],
        ("command", "session.close", 20),
        ("open", None, 0),
        ("touch", None, 0),
        ("close", None, 0),
    ]
