"""The formats a client's appends are parsed with follow the worker (services/api/delivery.py
`SessionView`, services/api/connection.py `_deliver`).

An append without a format of its own crosses to the worker with the one the pod resolved,
and the worker decodes it so. A session.update is therefore not applied by the pod: the
worker may refuse it (`voice_update_after_audio_unsupported`, ...). One that would change
the input format holds the client's next frames until the worker has answered it: accepted,
the appends after it are in the new format; refused, in the old one.

The worker here is the test: it answers on the connection's live feed, as a worker's
published events reach it, once the update is in its inbox."""

import asyncio
import base64

import orjson
import pytest

from services.api.connection import RealtimeConnection
from services.api.delivery import SessionView
from shared.protocol.duplex import AppendAudio
from tests.api.parts import RecordingInbox, make_parts, resumed_connection

SID = "duplex-v"
AT_24K = {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}}


@pytest.fixture
async def parts():
    parts = make_parts(inbox=RecordingInbox())
    yield parts
    await parts.close()


@pytest.fixture
async def conn(parts):
    """A connection whose attachment resumed `SID` (its session object declares no format:
    appends are pcm16 at 16 kHz), its delivery pump running."""
    connection, session = await resumed_connection(parts, SID)
    connection.update_answer_timeout_s = 5.0  # a test that waits this long has failed
    connection.view.observe(session)
    pump = asyncio.create_task(connection.delivery.pump())
    yield connection
    pump.cancel()


def update(session: dict, event_id: str | None = None) -> str:
    frame = {"type": "session.update", "session": session}
    return orjson.dumps(frame if event_id is None else {**frame, "event_id": event_id}).decode()


def append(event_id: str) -> str:
    audio = base64.b64encode(b"\x01\x00" * 320).decode()
    return orjson.dumps(
        {"type": "input_audio_buffer.append", "audio": audio, "event_id": event_id}
    ).decode()


def crossed(parts) -> list[tuple]:
    """What reached the worker's inbox, in order: an append as (event_id, format, rate),
    any other command as its type."""
    out: list = []
    for _, message, _ in parts.inbox.appended:
        command = message.command
        if isinstance(command, AppendAudio):
            out.append((command.event_id, command.format, command.sample_rate_hz))
        else:
            out.append(command.TYPE)
    return out


async def written(parts, count: int) -> None:
    """Until `count` commands are in the inbox (the worker can answer only what it has)."""
    async with asyncio.timeout(5):
        while len(parts.inbox.appended) < count:
            await asyncio.sleep(0.001)


async def held(conn: RealtimeConnection) -> None:
    """Until the reader waits for the worker's answer to the update (so the appends after it
    would have crossed by now if nothing held them)."""
    async with asyncio.timeout(10):
        while not conn.view.awaiting_answer:
            await asyncio.sleep(0.001)


async def delivered(conn: RealtimeConnection, count: int) -> list[str]:
    """The types of the next `count` events queued for the client: the pump has routed them,
    so the view has seen each (it reads an event before queueing it)."""
    async with asyncio.timeout(10):
        return [(await conn.delivery.get()).wire_type for _ in range(count)]


def worker_says(conn: RealtimeConnection, event: dict) -> None:
    conn.delivery.feed.push(orjson.dumps(event))


def refusal(code: str, event_id: str | None) -> dict:
    error = {"type": "invalid_request_error", "code": code, "message": "refused"}
    return {
        "type": "error",
        "error": error if event_id is None else {**error, "event_id": event_id},
    }


async def reader(conn: RealtimeConnection, *frames: str) -> None:
    """The socket's reader: frames handled one at a time, in order."""
    for frame in frames:
        await conn._handle_frame(frame)


async def test_a_refused_session_update_leaves_the_appends_after_it_in_the_old_format(parts, conn):
    """The worker refuses an update that also changes the input format: the appends the
    client sends right after it are still parsed (and decoded by the worker) as pcm16 at
    16 kHz. On fc101f1 the pod had applied the update when it forwarded it: they crossed
    as 24 kHz audio, and nothing told the client."""
    reading = asyncio.create_task(
        reader(conn, update({**AT_24K, "voice": "other"}, "u1"), append("a1"), append("a2"))
    )
    await written(parts, 1)
    worker_says(conn, refusal("voice_update_after_audio_unsupported", "u1"))
    await asyncio.wait_for(reading, 5)
    assert crossed(parts) == [
        "session.update",
        ("a1", "pcm16", 16000),
        ("a2", "pcm16", 16000),
    ]
    assert conn.view.defaults.input_format.rate == 16000


async def test_appends_right_after_an_accepted_update_wait_for_it_and_use_its_format(parts, conn):
    """Sent before session.updated came back, they cross after it, in the new format."""
    reading = asyncio.create_task(reader(conn, update(AT_24K, "u1"), append("a1")))
    await held(conn)
    assert crossed(parts) == ["session.update"]  # held until the worker answers
    worker_says(conn, {"type": "session.updated", "session": AT_24K})
    await asyncio.wait_for(reading, 5)
    assert crossed(parts) == ["session.update", ("a1", "pcm16", 24000)]


async def test_an_update_that_keeps_the_input_format_is_not_waited_for(parts, conn):
    await asyncio.wait_for(
        reader(conn, update({"instructions": "be brief", "voice": "other"}), append("a1")), 5
    )
    assert crossed(parts) == ["session.update", ("a1", "pcm16", 16000)]


async def test_only_the_updates_own_answer_releases_the_appends(parts, conn):
    """An earlier command's error, or an earlier update's session.updated (still the old
    format), is not the answer: the appends wait for the refusal that names the update."""
    reading = asyncio.create_task(reader(conn, update(AT_24K, "u2"), append("a1")))
    await held(conn)
    worker_says(conn, refusal("response_not_active", "c1"))
    worker_says(conn, {"type": "session.updated", "session": {"instructions": "earlier"}})
    worker_says(conn, refusal("conversation_already_has_active_response", None))
    assert await delivered(conn, 3) == ["error", "session.updated", "error"]
    assert conn.view.awaiting_answer  # none of them was the answer
    assert crossed(parts) == ["session.update"]
    worker_says(conn, refusal("invalid_session_config", "u2"))
    await asyncio.wait_for(reading, 5)
    assert crossed(parts) == ["session.update", ("a1", "pcm16", 16000)]


async def test_an_update_sent_without_an_event_id_is_answered_by_an_error_without_one(parts, conn):
    reading = asyncio.create_task(reader(conn, update(AT_24K), append("a1")))
    await written(parts, 1)
    worker_says(conn, refusal("voice_update_after_audio_unsupported", None))
    await asyncio.wait_for(reading, 5)
    assert crossed(parts) == ["session.update", ("a1", "pcm16", 16000)]


async def test_a_session_that_ends_unanswered_releases_the_reader(parts, conn):
    reading = asyncio.create_task(reader(conn, update(AT_24K, "u1")))
    await written(parts, 1)
    worker_says(conn, {"type": "session.closed", "reason": "worker_lost"})
    await asyncio.wait_for(reading, 5)
    assert not conn.attachment.live


async def test_without_an_answer_the_appends_go_in_the_format_the_worker_confirmed(parts, conn):
    conn.update_answer_timeout_s = 0.05
    await asyncio.wait_for(reader(conn, update(AT_24K, "u1"), append("a1")), 5)
    assert crossed(parts) == ["session.update", ("a1", "pcm16", 16000)]
    # a late session.updated still says what the worker does
    worker_says(conn, {"type": "session.updated", "session": AT_24K})
    async with asyncio.timeout(5):  # until the pump has delivered it
        while conn.view.defaults.input_format.rate != 24000:
            await asyncio.sleep(0.001)
    await reader(conn, append("a2"))
    assert crossed(parts)[-1] == ("a2", "pcm16", 24000)


async def test_an_update_the_inbox_refused_is_not_waited_for():
    """Not written, it will not be answered: the client hears input_backpressure at once."""
    parts = make_parts(inbox=RecordingInbox(refuse=True))
    try:
        connection, _ = await resumed_connection(parts, SID)
        await asyncio.wait_for(connection._handle_frame(update(AT_24K, "u1")), 1)
        error = orjson.loads((await connection.delivery.get()).data)
        assert error["error"]["code"] == "input_backpressure"
        assert error["error"]["event_id"] == "u1"
        assert connection.view.defaults.input_format.rate == 16000
    finally:
        await parts.close()


def test_the_view_changes_only_with_the_session_objects_the_worker_delivers():
    view = SessionView()
    assert view.expect(AT_24K, "u1") is True  # announced, not applied
    assert view.defaults.input_format.rate == 16000
    view.observe({"instructions": "an earlier update's"})
    assert view.defaults.input_format.rate == 16000
    view.observe(AT_24K)
    assert view.defaults.input_format.rate == 24000
    assert view.expect({"voice": "other"}, "u2") is False  # the input format stays
    assert view.expect({"input_audio_format": "mp3"}, "u3") is False  # the worker refuses it
