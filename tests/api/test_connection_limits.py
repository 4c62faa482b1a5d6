"""What a connection refuses before anything crosses Redis: appends over the session's
pending-input limit, and commands to a worker whose inbox is over its byte budget."""

import base64

import orjson
import pytest

from services.api.connection import RealtimeConnection
from shared.redis.boundary import CloseRequest, CommandRecord
from tests.api.parts import RecordingInbox, make_parts, resumed_connection


@pytest.fixture
async def parts_of():
    made = []

    def build(refuse: bool = False):
        made.append(make_parts(inbox=RecordingInbox(refuse)))
        return made[-1]

    yield build
    for parts in made:
        await parts.close()


async def connection(parts, limit: int) -> RealtimeConnection:
    """A connection whose attachment resumed `duplex-t` (generation 2, on worker-a)."""
    conn, _ = await resumed_connection(parts, "duplex-t", max_input_bytes=limit)
    return conn


async def queued(conn: RealtimeConnection) -> list[dict]:
    return [orjson.loads((await conn.delivery.get()).data) for _ in range(len(conn.delivery.queue))]


def append_frame(audio: bytes, event_id: str) -> str:
    body = {"type": "input_audio_buffer.append", "audio": base64.b64encode(audio).decode()}
    return orjson.dumps({**body, "event_id": event_id}).decode()


async def test_an_append_over_the_pending_input_limit_never_reaches_the_worker(parts_of):
    parts = parts_of()
    conn = await connection(parts, limit=1000)
    await conn._handle_frame(append_frame(b"\x00" * 1002, "big"))
    await conn._handle_frame(append_frame(b"\x00" * 1000, "fits"))
    [error] = await queued(conn)
    assert error["error"]["code"] == "input_backpressure"
    assert error["error"]["event_id"] == "big"
    assert len(parts.inbox.appended) == 1  # only the one that fits was written
    assert parts.inbox.appended[0][1].audio == b"\x00" * 1000


async def test_a_full_inbox_refuses_appends_with_a_retryable_error_but_not_control(parts_of):
    parts = parts_of(refuse=True)
    conn = await connection(parts, limit=1 << 20)
    await conn._handle_frame(append_frame(b"\x00" * 640, "a1"))
    [error] = await queued(conn)
    assert error["error"]["code"] == "input_backpressure"
    assert error["error"]["retryable"] is True and error["error"]["event_id"] == "a1"
    assert parts.inbox.appended == []
    await conn._handle_frame(orjson.dumps({"type": "session.heartbeat"}).decode())
    await conn._handle_frame(orjson.dumps({"type": "response.cancel"}).decode())
    await conn._handle_frame(orjson.dumps({"type": "session.close"}).decode())
    await conn.attachment.close("output_overflow")
    # what keeps a session alive or stops it always gets through to a flooded worker
    kinds = [
        (type(m), getattr(m, "command_type", None), getattr(m, "seq", 0))
        for _, m, _ in parts.inbox.appended
    ]
    assert kinds == [
        (CommandRecord, "session.heartbeat", 1),  # the refused append gave its seq back
        (CommandRecord, "response.cancel", 2),
        (CommandRecord, "session.close", 3),
        (CloseRequest, None, 0),
    ]
    assert await queued(conn) == []


async def test_a_large_frame_is_parsed_off_the_event_loop(monkeypatch, parts_of):
    import threading

    import services.api.connection as connection_module

    threads: list[int] = []
    real_parse = connection_module.parse_client_event

    def recording_parse(frame, context=None):
        threads.append(threading.get_ident())
        return real_parse(frame, context)

    monkeypatch.setattr(connection_module, "parse_client_event", recording_parse)
    parts = parts_of()
    conn = await connection(parts, limit=16 << 20)
    small, large = b"\x01\x00" * 100, b"\x02\x00" * (512 * 1024)
    await conn._handle_frame(append_frame(small, "small"))
    await conn._handle_frame(append_frame(large, "large"))
    loop_thread = threading.get_ident()
    assert threads[0] == loop_thread and threads[1] != loop_thread
    assert [m.audio for _, m, _ in parts.inbox.appended] == [small, large]  # in order


async def test_a_frame_parsed_while_its_socket_was_taken_over_is_dropped(monkeypatch, parts_of):
    import services.api.connection as connection_module

    parts = parts_of()
    conn = await connection(parts, limit=16 << 20)
    real_parse = connection_module.parse_client_event

    def parse_then_taken_over(frame, context=None):
        assert conn.attachment.taken_over(3)  # a resume elsewhere, while this frame was parsed
        return real_parse(frame, context)

    monkeypatch.setattr(connection_module, "parse_client_event", parse_then_taken_over)
    await conn._handle_frame(append_frame(b"\x02\x00" * (512 * 1024), "late"))
    assert parts.inbox.appended == [] and await queued(conn) == []
