"""What a connection refuses before anything crosses Redis: appends over the session's
pending-input limit, and commands to a worker whose inbox is over its byte budget."""

import base64
import types

import orjson

from services.api.connection import RealtimeConnection
from services.api.inbox_writer import InboxFull
from services.api.metrics import ApiMetrics
from shared.contracts import SessionRuntimeConfig
from shared.redis.keys import KeySchema
from shared.redis.messages import CLOSE, InboxMessage


class RecordingWriter:
    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.appended: list[tuple[str, dict, bool]] = []

    async def append(self, worker_id: str, fields: dict, *, budgeted: bool = True) -> None:
        if self.refuse and budgeted:
            raise InboxFull("over budget")
        self.appended.append((worker_id, fields, budgeted))


async def touched(*args, **kwargs) -> int:
    return 1


def connection(writer: RecordingWriter, limit: int) -> RealtimeConnection:
    pod = types.SimpleNamespace(
        runtime=SessionRuntimeConfig(max_pending_input_bytes_per_session=limit),
        settings=types.SimpleNamespace(api_keys=frozenset(), pod_id="api-t"),
        metrics=ApiMetrics(),
        inbox_writer=writer,
        keys=KeySchema(),
        store=types.SimpleNamespace(touch=touched),
    )
    conn = RealtimeConnection(None, pod, model=None, autostart=True, resume_only=False)
    conn.session_id, conn.worker_id, conn.generation = "duplex-t", "w", 1
    return conn


def queued(conn: RealtimeConnection) -> list[dict]:
    return [orjson.loads(item.data) for item in conn.queue._items]


def append_frame(audio: bytes, event_id: str) -> str:
    body = {"type": "input_audio_buffer.append", "audio": base64.b64encode(audio).decode()}
    return orjson.dumps({**body, "event_id": event_id}).decode()


async def test_an_append_over_the_pending_input_limit_never_reaches_the_worker():
    writer = RecordingWriter()
    conn = connection(writer, limit=1000)
    await conn._handle_frame(append_frame(b"\x00" * 1002, "big"))
    await conn._handle_frame(append_frame(b"\x00" * 1000, "fits"))
    [error] = queued(conn)
    assert error["error"]["code"] == "input_backpressure"
    assert error["error"]["event_id"] == "big"
    assert len(writer.appended) == 1  # only the one that fits was written
    assert writer.appended[0][1]["b"] == b"\x00" * 1000


async def test_a_full_inbox_refuses_appends_with_a_retryable_error_but_not_control():
    writer = RecordingWriter(refuse=True)
    conn = connection(writer, limit=1 << 20)
    await conn._handle_frame(append_frame(b"\x00" * 640, "a1"))
    [error] = queued(conn)
    assert error["error"]["code"] == "input_backpressure"
    assert error["error"]["retryable"] is True and error["error"]["event_id"] == "a1"
    assert writer.appended == []
    await conn._handle_frame(orjson.dumps({"type": "session.heartbeat"}).decode())
    await conn._handle_frame(orjson.dumps({"type": "response.cancel"}).decode())
    await conn._handle_frame(orjson.dumps({"type": "session.close"}).decode())
    await conn._xadd("w", InboxMessage(CLOSE, "duplex-t", 1, 0, {"reason": "disconnect"}))
    # what keeps a session alive or stops it always gets through to a flooded worker
    kinds = [
        (fields["k"], orjson.loads(fields["p"]).get("type")) for _, fields, _ in writer.appended
    ]
    assert kinds == [
        ("command", "session.heartbeat"),
        ("command", "response.cancel"),
        ("command", "session.close"),
        ("close", None),
    ]
    assert len(queued(conn)) == 1


async def test_a_large_frame_is_parsed_off_the_event_loop(monkeypatch):
    import threading

    import services.api.connection as connection_module

    threads: list[int] = []
    real_parse = connection_module.parse_client_event

    def recording_parse(frame, context=None):
        threads.append(threading.get_ident())
        return real_parse(frame, context)

    monkeypatch.setattr(connection_module, "parse_client_event", recording_parse)
    writer = RecordingWriter()
    conn = connection(writer, limit=16 << 20)
    small, large = b"\x01\x00" * 100, b"\x02\x00" * (512 * 1024)
    await conn._handle_frame(append_frame(small, "small"))
    await conn._handle_frame(append_frame(large, "large"))
    loop_thread = threading.get_ident()
    assert threads[0] == loop_thread and threads[1] != loop_thread
    assert [fields["b"] for _, fields, _ in writer.appended] == [small, large]  # in order


async def test_a_frame_parsed_while_its_socket_was_taken_over_is_dropped(monkeypatch):
    import services.api.connection as connection_module

    writer = RecordingWriter()
    conn = connection(writer, limit=16 << 20)
    real_parse = connection_module.parse_client_event

    def parse_then_taken_over(frame, context=None):
        conn.replaced = True  # a resume elsewhere, while this large frame was parsed
        return real_parse(frame, context)

    monkeypatch.setattr(connection_module, "parse_client_event", parse_then_taken_over)
    await conn._handle_frame(append_frame(b"\x02\x00" * (512 * 1024), "late"))
    assert writer.appended == [] and queued(conn) == []


async def test_an_open_whose_created_event_was_missed_is_answered_from_the_hash():
    """No polling: the hash is read when the hub says it reconnected (CATCH_UP), or once
    when the open timeout runs out."""
    from services.api.live import CATCH_UP

    created = {"state": "active", "session": orjson.dumps({"id": "duplex-t"}).decode()}
    answers = [{"state": "opening"}, created]  # what the hash says at each read
    reads: list[str] = []

    async def meta(session_id: str) -> dict:
        reads.append(session_id)
        return answers[min(len(reads), len(answers)) - 1]

    conn = connection(RecordingWriter(), limit=1 << 20)
    conn.pod.store.meta = meta
    conn.pod.settings.open_timeout_s = 30.0
    conn.live.put_nowait(b"!takeover 2")  # control notices are skipped
    conn.live.put_nowait(CATCH_UP)  # reconnected, but the worker had not answered yet
    conn.live.put_nowait(CATCH_UP)  # reconnected again: now the hash has it
    reply = await conn._first_reply()
    assert reply["type"] == "session.created" and reply["session"] == {"id": "duplex-t"}
    assert len(reads) == 2  # one read per CATCH_UP, none on a timer
    answers[:] = [{"state": "opening"}]
    reads.clear()
    conn.pod.settings.open_timeout_s = 0.05
    assert await conn._first_reply() is None  # timed out, and the hash has nothing either
    assert len(reads) == 1  # read once, at the timeout
