"""The API-to-worker records (shared/redis/boundary.py, shared/redis/inbox_codec.py): each
inbox message round-trips through the entry Redis holds, an entry is decoded with one
decoder call, commands cross validated once (built by msgspec, never parsed again, audio
never base64), entries no API pod wrote are refused whole, and the records a Redis reader
needs come without the wire codec."""

import base64
import dataclasses
import subprocess
import sys
from pathlib import Path

import msgspec
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shared.protocol.duplex as duplex
import shared.redis.inbox_codec as inbox_codec
from shared.protocol.duplex import (
    DUPLEX_COMMANDS,
    AckPlayback,
    AppendAudio,
    AppendText,
    BargeIn,
    CancelInput,
    CancelResponse,
    ClearInput,
    ClearOutputAudio,
    CloseSession,
    Commit,
    CreateItem,
    CreateResponse,
    DeleteItem,
    Heartbeat,
    SignalTurn,
    TruncateItem,
    UpdateSession,
    normalize_item,
    parse_client_event,
)
from shared.protocol.duplex.commands import INBOX_FIELDS
from shared.redis.boundary import (
    MIN_ENTRY_BYTES,
    ChatReply,
    ChatRequest,
    CloseRequest,
    CommandRecord,
    ControlNotice,
    InboxRecord,
    MalformedEntry,
    OpenRequest,
    RestoreRequest,
    TouchRequest,
    UnknownCommand,
    WorkerRegistration,
    decode_entry,
    encode_entry,
    entry_bytes,
)
from shared.redis.keys import KeySchema
from tests.protocol.strategies import client_command

ROOT = Path(__file__).resolve().parents[2]
KEYS = KeySchema()
SID = "duplex-0123456789abcdef0123456789abcdef"

#: one instance of every command a worker receives, every field away from its default
COMMANDS = [
    UpdateSession(
        event_id="e1",
        patch={"instructions": "be brief", "audio": {"input": {"format": {"type": "audio/pcm"}}}},
    ),
    ClearInput(event_id="e2"),
    ClearOutputAudio(event_id="e3", response_id="resp_1"),
    CreateResponse(event_id="e4", options={"modalities": ["text"], "temperature": 0.7}),
    CancelResponse(event_id="e5", response_id="resp_2"),
    CreateItem(
        event_id="e6",
        item=normalize_item(
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "hi"}],
            }
        ),
        previous_item_id="item_0",
    ),
    DeleteItem(event_id="e7", item_id="item_1"),
    TruncateItem(event_id="e8", item_id="item_2", content_index=1, audio_end_ms=1500.5),
    AppendAudio(
        event_id="e9",
        audio=bytes(range(160)),
        format="pcm_f32le",
        sample_rate_hz=24_000,
        is_speech=True,
        video_frames=("AAAA", "/w=="),
        duration_ms=20,
        audio_end_ms=40.5,
        hints={"speech_probability": 0.9, "vad": {"rms": 12}},
    ),
    Commit(event_id="e10", final=False, create_response=False, is_speech=False),
    AppendText(event_id="e11", text="hello"),
    CancelInput(event_id="e12"),
    BargeIn(event_id="e13"),
    SignalTurn(event_id="e14", event="conversation.item.retrieve", payload={"item_id": "i3"}),
    AckPlayback(
        event_id="e15",
        played_ms=120,
        committed_ms=100.5,
        response_id="resp_3",
        item_id="item_4",
        truncate=True,
    ),
    Heartbeat(event_id="e16"),
    CloseSession(event_id="e17", reason="done"),
]


def as_read(fields: dict) -> dict[bytes, bytes]:
    """Stream fields as XREADGROUP returns them: bytes keys, bytes values."""
    return {
        key.encode(): value if isinstance(value, bytes) else str(value).encode()
        for key, value in fields.items()
    }


def through_inbox(record: InboxRecord) -> InboxRecord:
    return InboxRecord.from_fields(as_read(record.to_fields()))


def test_the_instances_cover_every_command_with_every_field_set():
    assert {type(c) for c in COMMANDS} == set(DUPLEX_COMMANDS.values())
    for command in COMMANDS:
        for field in dataclasses.fields(command):
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                continue  # required: any value will do
            assert getattr(command, field.name) != default, (type(command).__name__, field.name)
        # each is what the API pod could have validated
        assert parse_client_event(command.to_dict()) == command


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.TYPE)
def test_every_command_round_trips_to_an_equal_command(command):
    record = CommandRecord(SID, 3, 7, command)
    again = through_inbox(record)
    assert again == record and type(again.command) is type(command)
    assert CommandRecord.from_fields(as_read(record.to_fields())) == record


#: a client frame of every command type, as a client sends it (aliases and the OpenAI
#: shapes included), for the API pod's parser
FRAMES = [
    {"type": "session.update", "event_id": "f1", "session": {"instructions": "be brief"}},
    {"type": "input_audio_buffer.clear"},
    {"type": "output_audio_buffer.clear", "event_id": "f3", "response_id": "resp_1"},
    {"type": "response.create", "response": {"modalities": ["text"]}},
    {"type": "response.cancel", "event_id": "f5"},
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "hi"}],
        },
    },
    {"type": "conversation.item.delete", "item_id": "item_1"},
    {
        "type": "conversation.item.truncate",
        "item_id": "i2",
        "content_index": 0,
        "audio_end_ms": 900,
    },
    {
        "type": "input_audio_buffer.append",
        "event_id": "f9",
        "audio": base64.b64encode(b"\x01\x00" * 320).decode(),
        "is_speech": True,
        "duration_ms": 20,
        "speech_probability": 0.75,
        "video_frames": ["data:image/jpeg;base64,AAAA"],
    },
    {"type": "input.commit", "event_id": "f10"},
    {"type": "push_text", "text": "hello"},
    {"type": "input.cancel"},
    {"type": "barge_in", "event_id": "f13"},
    {"type": "turn.signal", "event": "user_turn_end", "payload": {"why": "button"}},
    {"type": "audio.playback_ack", "played_ms": 240.5, "response_id": "resp_2", "truncate": True},
    {"type": "session.heartbeat", "event_id": "f16"},
    {"type": "close", "reason": "bye"},
]


def test_every_command_class_crosses_from_a_real_client_frame():
    """msgspec encodes and decodes every command class by its attribute names: each frame,
    parsed as the API pod parses it, reaches the worker as an equal command of its class."""
    commands = [parse_client_event(orjson.dumps(frame)) for frame in FRAMES]
    assert {type(c) for c in commands} == set(DUPLEX_COMMANDS.values())
    records = [CommandRecord(SID, 1, seq, c) for seq, c in enumerate(commands, start=1)]
    fields = encode_entry(records)
    assert decode_entry(as_read(fields)) == records
    for record in decode_entry(as_read(fields)):
        assert type(record.command) is DUPLEX_COMMANDS[record.command.TYPE]


@pytest.mark.parametrize("wire_type", sorted(DUPLEX_COMMANDS))
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_generated_commands_round_trip(wire_type, data):
    command = data.draw(client_command(DUPLEX_COMMANDS[wire_type]))
    assert through_inbox(CommandRecord(SID, 1, 1, command)).command == command


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.TYPE)
def test_the_entry_carries_the_command_by_its_attributes_and_raw_audio(command):
    """docs/redis-keys.md: `c` is [wire type, the command's attributes] (an append: its
    validated fields but the audio), `b<i>` the audio."""
    fields = CommandRecord(SID, 3, 7, command).to_fields()
    [message] = orjson.loads(fields["m"])
    assert {k: message[k] for k in "ksaq"} == {"k": "command", "s": SID, "a": 3, "q": 7}
    wire_type, body = message["c"]
    assert wire_type == command.TYPE
    if isinstance(command, AppendAudio):  # its validated fields, the audio raw beside them
        assert fields["b0"] == command.audio
        assert body == dict(zip(INBOX_FIELDS, command.inbox_fields(), strict=True))
    else:
        assert set(fields) == {"m"}
        assert body == msgspec.to_builtins(command)


def test_an_entry_is_decoded_with_one_decoder_call(monkeypatch):
    """One msgspec call per entry builds every typed message of it, the commands included:
    no second decode, no conversion, no parse of the client's frame."""
    records = [CommandRecord(SID, 1, n, c) for n, c in enumerate(COMMANDS, start=1)]
    records += [r for r in RECORDS if not isinstance(r, CommandRecord)]
    fields = as_read(encode_entry(records))
    codec = inbox_codec._codec()
    calls = []

    class Spy:
        def decode(self, data):
            calls.append(len(data))
            return real.decode(data)

    def refuse(*args, **kwargs):
        raise AssertionError("a second decode, or a command parsed or validated again")

    real = codec.entry
    monkeypatch.setattr(codec, "entry", Spy())
    for name in ("raw_list", "one", "unknown"):
        monkeypatch.setattr(codec, name, type("Refuse", (), {"decode": refuse})())
    monkeypatch.setattr(msgspec.json, "decode", refuse)
    monkeypatch.setattr(msgspec, "convert", refuse)
    monkeypatch.setattr(orjson, "loads", refuse)
    monkeypatch.setattr(duplex, "parse_client_event", refuse)
    monkeypatch.setattr(duplex.commands, "parse_client_event", refuse)
    for cls in DUPLEX_COMMANDS.values():
        monkeypatch.setattr(cls, "from_wire", classmethod(refuse))
        monkeypatch.setattr(cls, "read_fields", classmethod(refuse))
        monkeypatch.setattr(cls, "from_inbox_fields", classmethod(refuse), raising=False)
    assert decode_entry(fields) == records
    assert calls == [len(fields[b"m"])]


def test_an_appends_audio_is_never_base64_encoded(monkeypatch):
    encoded: list[int] = []
    real = base64.b64encode

    def spy(data, *args):
        encoded.append(len(data))
        return real(data, *args)

    monkeypatch.setattr(base64, "b64encode", spy)
    audio = b"\x01\x00" * 200_000
    append = AppendAudio(event_id="a1", audio=audio, is_speech=True)
    fields = CommandRecord(SID, 1, 1, append).to_fields()
    again = CommandRecord.from_fields(as_read(fields))
    assert again.command == append
    assert fields["b0"] is audio  # the very bytes the API decoded, not a copy
    assert b'"audio"' not in fields["m"] and len(fields["m"]) < 200  # msgspec did not b64 it
    assert not encoded, encoded
    assert entry_bytes(fields) == entry_bytes(as_read(fields)) == len(fields["m"]) + len(audio)


def test_an_empty_append_still_has_its_audio_field():
    append = AppendAudio(event_id="a0", audio=b"")
    fields = CommandRecord(SID, 1, 1, append).to_fields()
    assert fields["b0"] == b""
    assert CommandRecord.from_fields(as_read(fields)).command == append


def test_a_command_of_an_unknown_type_is_refused_alone_and_forwarded_as_read():
    """A newer API pod's command: the worker answers unknown_event (process.py); the other
    messages of its entry are read as usual, and it re-encodes as it came."""
    records = [CommandRecord(SID, 1, 1, COMMANDS[8]), CommandRecord(SID, 1, 2, Heartbeat())]
    fields = as_read(encode_entry(records))
    unknown = (
        b'{"k":"command","s":"duplex-x","a":2,"q":5,'
        b'"c":["input.telepathy",{"event_id":"e9","x":[1]}]}'
    )
    fields[b"m"] = fields[b"m"][:1] + unknown + b"," + fields[b"m"][1:]
    fields[b"b1"] = fields.pop(b"b0")  # the append is message 1 now
    first, *rest = decode_entry(fields)
    assert rest == records
    assert first == UnknownCommand(
        "duplex-x", 2, 5, ("input.telepathy", {"event_id": "e9", "x": [1]})
    )
    assert (first.command_type, first.event_id) == ("input.telepathy", "e9")
    assert encode_entry([first])["m"] == b"[" + unknown + b"]"
    assert UnknownCommand("s", 1, 1, ("t", {"event_id": 5})).event_id is None


def good_entry() -> dict[bytes, bytes]:
    """An API pod's entry: an append, a commit, a close."""
    records = [CommandRecord(SID, 1, 1, COMMANDS[8]), CommandRecord(SID, 1, 2, COMMANDS[9])]
    return as_read(encode_entry([*records, CloseRequest(SID)]))


def altered(**changes: bytes | None) -> dict[bytes, bytes]:
    fields = good_entry()
    for name, value in changes.items():
        if value is None:
            del fields[name.encode()]
        else:
            fields[name.encode()] = value
    return fields


def header(replace: bytes, by: bytes) -> dict[bytes, bytes]:
    fields = good_entry()
    assert replace in fields[b"m"]
    fields[b"m"] = fields[b"m"].replace(replace, by, 1)
    return fields


MALFORMED = {
    "no messages": altered(m=None),
    "not JSON": altered(m=b"not json"),
    "not an array": altered(m=b'{"k":"close","s":"x"}'),
    "an array of arrays (the old headers)": altered(m=b'[["command","duplex-x",1,1,{}]]'),
    "an attachment as a string": header(b'"a":1', b'"a":"1"'),
    "a session id as a number": header(b'"s":"duplex-', b'"s":5,"x":"'),
    "a seq missing": header(b',"q":2', b""),
    "an unknown tag": header(b'"k":"close"', b'"k":"teleport"'),
    "no tag": header(b'"k":"close",', b""),
    "a known command with a field of the wrong type": header(b'"final":false', b'"final":"no"'),
    "an append's rate as a string": header(b'"sample_rate_hz":24000', b'"sample_rate_hz":"24000"'),
    "a command body that is not [type, object]": header(
        b'["input_audio_buffer.commit",', b'["input_audio_buffer.commit",1,'
    ),
    "an append without its audio field": altered(b0=None),
}


@pytest.mark.parametrize("fields", MALFORMED.values(), ids=MALFORMED.keys())
def test_an_entry_no_api_pod_wrote_is_refused_whole(fields):
    with pytest.raises(MalformedEntry):
        decode_entry(fields)


def test_the_malformed_entries_differ_from_a_good_one_only_where_they_say():
    assert len(decode_entry(good_entry())) == 3


RECORDS = [
    OpenRequest(SID, {"model": "echo", "instructions": "hi"}),
    CommandRecord(SID, 2, 5, Heartbeat(event_id="h1")),
    CloseRequest(SID, "maintenance"),
    CloseRequest(SID, "disconnect", attachment=4),
    TouchRequest(SID, 3),
    ChatRequest("0123abcd", [{"role": "user", "content": "hi"}]),
    RestoreRequest(SID, 3, "drain", "worker-a"),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_inbox_record_round_trips(record):
    assert through_inbox(record) == record
    assert type(record).from_fields(as_read(record.to_fields())) == record
    other = OpenRequest if not isinstance(record, OpenRequest) else TouchRequest
    with pytest.raises(ValueError, match="is not a"):
        other.from_fields(as_read(record.to_fields()))


def test_the_records_entries_are_what_redis_keys_md_shows():
    """Each message is a JSON object tagged by `k`, readable in redis-cli."""
    shown = [orjson.loads(record.to_fields()["m"]) for record in RECORDS]
    assert shown == [
        [{"k": "open", "s": SID, "session": {"model": "echo", "instructions": "hi"}, "a": 1}],
        [
            {
                "k": "command",
                "s": SID,
                "a": 2,
                "q": 5,
                "c": ["session.heartbeat", {"event_id": "h1"}],
            }
        ],
        [{"k": "close", "s": SID, "reason": "maintenance", "a": 0}],
        [{"k": "close", "s": SID, "reason": "disconnect", "a": 4}],
        [{"k": "touch", "s": SID, "a": 3}],
        [{"k": "chat", "s": "0123abcd", "messages": [{"role": "user", "content": "hi"}]}],
        [
            {
                "k": "restore",
                "s": SID,
                "owner_generation": 3,
                "reason": "drain",
                "from_worker": "worker-a",
            }
        ],
    ]
    assert RECORDS[5].session_id == RECORDS[5].request_id == "0123abcd"
    assert CloseRequest(SID).reason == "client_close"


def test_many_messages_share_one_entry_in_order():
    records = [
        *RECORDS,
        CommandRecord(SID, 1, 9, COMMANDS[8]),
        CommandRecord(SID, 1, 10, COMMANDS[8]),
    ]
    fields = encode_entry(records)
    assert set(fields) == {"m", "b7", "b8"}
    assert decode_entry(as_read(fields)) == records
    assert entry_bytes(fields) == len(fields["m"]) + 2 * len(COMMANDS[8].audio)
    assert entry_bytes(encode_entry([CloseRequest(SID)])) == MIN_ENTRY_BYTES


def test_chat_replies_round_trip():
    for reply in (ChatReply.answer("hello there"), ChatReply.failure("bad_event", "no chat")):
        assert ChatReply.parse(reply.to_bytes()) == reply
    assert orjson.loads(ChatReply.answer("hi").to_bytes()) == {"ok": True, "text": "hi"}
    assert orjson.loads(ChatReply.failure("c", "m").to_bytes()) == {
        "ok": False,
        "code": "c",
        "message": "m",
    }


REGISTRATION = WorkerRegistration(
    worker_id="worker-a",
    model="echo",
    max_sessions=8,
    active=3,
    capabilities={"supports_session_resume": True, "supports_chat_completions": False},
    version="0.1.0",
    started_at=1_700_000_000_000,
)


def test_a_registration_round_trips_through_its_hash():
    fields = REGISTRATION.to_hash()
    assert list(fields) == [
        "model",
        "max_sessions",
        "active",
        "capabilities",
        "version",
        "started_at",
        "draining",
    ]
    assert WorkerRegistration.from_hash("worker-a", as_read(fields)) == REGISTRATION
    draining = dataclasses.replace(REGISTRATION, draining=True)
    assert WorkerRegistration.from_hash("worker-a", as_read(draining.to_hash())) == draining
    assert WorkerRegistration.from_hash("worker-a", {}) is None
    # a load update that outlived the hash (Redis restarted, the worker stopped) is no worker
    load = as_read(WorkerRegistration.load_fields(2))
    assert load == {b"active": b"2"}
    assert WorkerRegistration.from_hash("worker-a", load) is None


def test_control_notices_round_trip():
    notice = ControlNotice.takeover(3)
    assert notice.to_bytes() == b"!takeover 3"
    assert ControlNotice.parse(notice.to_bytes()) == notice
    assert notice.replaces(2) and not notice.replaces(3) and not notice.replaces(4)
    assert ControlNotice.parse(b'{"type":"session.updated"}') is None
    assert not ControlNotice.parse(b"!catchup").replaces(0)  # the API pod's own marker


def test_a_moved_notice_names_the_new_owner_and_replaces_no_socket():
    notice = ControlNotice.moved(4, "worker-b")
    assert notice.to_bytes() == b"!moved 4 worker-b"
    parsed = ControlNotice.parse(notice.to_bytes())
    assert parsed == notice and parsed.owner_generation == 4 and parsed.worker_id == "worker-b"
    assert not parsed.replaces(0)
    assert ControlNotice.takeover(5).owner_generation == 0


def test_a_restore_request_round_trips_through_an_inbox_entry():
    request = RestoreRequest("sess_1", 3, "drain", "worker-a")
    assert decode_entry(as_read(request.to_fields())) == [request]
    assert RestoreRequest.from_fields(
        as_read(RestoreRequest("s", 2, "worker_lost").to_fields())
    ) == (RestoreRequest("s", 2, "worker_lost"))


async def test_records_round_trip_through_redis(redis_client):
    inbox = KEYS.inbox("worker-a")
    ids = [await redis_client.xadd(inbox, record.to_fields()) for record in RECORDS]
    append = CommandRecord(SID, 1, 9, COMMANDS[8])
    ids.append(await redis_client.xadd(inbox, append.to_fields()))
    read = await redis_client.xrange(inbox)
    assert [entry_id for entry_id, _ in read] == ids
    assert [InboxRecord.from_fields(fields) for _, fields in read] == [*RECORDS, append]

    await redis_client.hset(KEYS.worker("worker-a"), mapping=REGISTRATION.to_hash())
    await redis_client.hset(KEYS.worker("worker-a"), mapping=WorkerRegistration.load_fields(5))
    stored = await redis_client.hgetall(KEYS.worker("worker-a"))
    expected = dataclasses.replace(REGISTRATION, active=5)
    assert WorkerRegistration.from_hash("worker-a", stored) == expected


def test_the_redis_readers_records_come_without_the_wire_codec():
    """`duplex sessions close` and `duplex workers` use this module: writing a close (and
    reading a registration, a notice, a reply) must not load the codec (numpy with it);
    reading an entry does (its commands are decoded)."""
    code = (
        "import sys\n"
        "from shared.redis.boundary import *\n"
        "close = CloseRequest('duplex-x', 'admin_close').to_fields()\n"
        "WorkerRegistration.from_hash('w', {b'model': b'echo'})\n"
        "ControlNotice.parse(ControlNotice.takeover(2).to_bytes())\n"
        "ChatReply.parse(ChatReply.answer('x').to_bytes())\n"
        "def loaded():\n"
        "    return sorted(m for m in sys.modules if m == 'numpy' or m.startswith('shared.prot'))\n"
        "print(loaded())\n"
        "read = {k.encode(): v for k, v in close.items()}\n"
        "assert decode_entry(read) == [CloseRequest('duplex-x', 'admin_close')]\n"
        "print('shared.protocol.duplex' in loaded())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.splitlines() == ["[]", "True"]
