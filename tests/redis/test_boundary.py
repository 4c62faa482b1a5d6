"""The API-to-worker records (shared/redis/boundary.py): each one round-trips through the form
Redis holds, commands cross validated once (rebuilt, never parsed again, audio never base64),
and the records a Redis reader needs come without the wire codec."""

import base64
import dataclasses
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shared.protocol.duplex as duplex
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
    RealtimeProtocolError,
    SignalTurn,
    TruncateItem,
    UpdateSession,
    normalize_item,
    parse_client_event,
)
from shared.redis.boundary import (
    CLOSE,
    OPEN,
    TOUCH,
    ChatReply,
    ChatRequest,
    CloseRequest,
    CommandRecord,
    ControlNotice,
    InboxMessage,
    InboxRecord,
    OpenRequest,
    RestoreRequest,
    TouchRequest,
    WorkerRegistration,
    entry_bytes,
    rebuild_command,
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
    message = InboxMessage.from_fields(as_read(record.to_fields()))
    assert CommandRecord.from_message(message).command == command


@pytest.mark.parametrize("wire_type", sorted(DUPLEX_COMMANDS))
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_generated_commands_round_trip(wire_type, data):
    command = data.draw(client_command(DUPLEX_COMMANDS[wire_type]))
    assert through_inbox(CommandRecord(SID, 1, 1, command)).command == command


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.TYPE)
def test_the_entry_carries_the_commands_wire_json_and_raw_audio(command):
    """docs/redis-keys.md: `p` is the command as the client codec renders it (an append: its
    fields as a JSON array), `b` the audio."""
    fields = CommandRecord(SID, 3, 7, command).to_fields()
    assert {k: fields[k] for k in "ksaq"} == {"k": "command", "s": SID, "a": 3, "q": 7}
    payload = orjson.loads(fields["p"])
    if isinstance(command, AppendAudio):  # its validated fields, the audio raw beside them
        assert fields["b"] == command.audio
        assert payload == command.inbox_fields() and len(payload) == 8
    else:
        assert "b" not in fields and payload == command.to_dict()


def test_the_worker_rebuilds_commands_without_parsing_or_validating(monkeypatch):
    entries = [as_read(CommandRecord(SID, 1, n, c).to_fields()) for n, c in enumerate(COMMANDS)]

    def refuse(*args, **kwargs):
        raise AssertionError("a command was parsed or validated again")

    monkeypatch.setattr(duplex, "parse_client_event", refuse)
    monkeypatch.setattr(duplex.commands, "parse_client_event", refuse)
    for cls in DUPLEX_COMMANDS.values():
        monkeypatch.setattr(cls, "from_wire", classmethod(refuse))
        monkeypatch.setattr(cls, "read_fields", classmethod(refuse))
    rebuilt = [CommandRecord.from_fields(fields).command for fields in entries]
    assert rebuilt == COMMANDS


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
    assert fields["b"] is audio  # the very bytes the API decoded, not a copy
    assert "audio" not in orjson.loads(fields["p"]) and len(fields["p"]) < 200
    assert not any(encoded), encoded  # nothing but the empty placeholder was encoded
    assert entry_bytes(fields) == entry_bytes(as_read(fields)) == len(fields["p"]) + len(audio)


def test_an_unknown_command_type_is_refused_as_the_contract_says():
    with pytest.raises(RealtimeProtocolError) as refused:
        rebuild_command({"type": "input.telepathy", "event_id": "e9"})
    assert refused.value.code == "unknown_event" and refused.value.related_event_id == "e9"
    with pytest.raises(RealtimeProtocolError):
        rebuild_command({"event_id": "e9"})


RECORDS = [
    OpenRequest(SID, {"model": "echo", "instructions": "hi"}),
    CommandRecord(SID, 2, 5, Heartbeat(event_id="h1")),
    CloseRequest(SID, "maintenance"),
    CloseRequest(SID, "disconnect", attachment=4),
    TouchRequest(SID, 3),
    ChatRequest("0123abcd", [{"role": "user", "content": "hi"}]),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_inbox_record_round_trips(record):
    assert through_inbox(record) == record
    assert type(record).from_fields(as_read(record.to_fields())) == record
    other = OpenRequest if not isinstance(record, OpenRequest) else TouchRequest
    with pytest.raises(ValueError, match="is not a"):
        other.from_fields(as_read(record.to_fields()))


def test_records_write_the_entries_the_old_envelopes_wrote():
    """API code that still builds `InboxMessage`s and workers that read records agree."""
    pairs = [
        (InboxMessage(OPEN, SID, 1, 0, {"session": {"model": "echo"}}), OpenRequest),
        (InboxMessage(CLOSE, SID, 0, 0, {"reason": "admin_close"}), CloseRequest),
        (InboxMessage(CLOSE, SID, 2, 0, {"reason": "disconnect"}), CloseRequest),
        (InboxMessage(TOUCH, SID, 4), TouchRequest),
        (InboxMessage("chat", "r1", payload={"messages": []}), ChatRequest),
    ]
    for message, cls in pairs:
        record = message.record()
        assert type(record) is cls and record.to_fields() == message.to_fields()
    assert CloseRequest(SID).reason == InboxMessage(CLOSE, SID).record().reason == "client_close"
    with pytest.raises(ValueError, match="unknown inbox entry kind"):
        InboxMessage("teleport", SID).record()


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
    assert InboxMessage.from_fields(as_read(request.to_fields())).record() == request
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
    """`duplex sessions close` and `duplex workers` use this module: it must not load the
    codec (numpy with it) until a command is decoded."""
    code = (
        "import sys\n"
        "from shared.redis.boundary import *\n"
        "close = CloseRequest('duplex-x', 'admin_close').to_fields()\n"
        "assert InboxRecord.from_fields({k.encode(): str(v).encode() if not isinstance(v, bytes)"
        " else v for k, v in close.items()}) == CloseRequest('duplex-x', 'admin_close')\n"
        "WorkerRegistration.from_hash('w', {b'model': b'echo'})\n"
        "ControlNotice.parse(ControlNotice.takeover(2).to_bytes())\n"
        "ChatReply.parse(ChatReply.answer('x').to_bytes())\n"
        "def loaded():\n"
        "    return sorted(m for m in sys.modules if m == 'numpy' or m.startswith('shared.prot'))\n"
        "print(loaded())\n"
        "InboxMessage('command', 's', 1, 1, {'type': 'session.heartbeat'}).record()\n"
        "print('shared.protocol.duplex' in loaded())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.splitlines() == ["[]", "True"]
