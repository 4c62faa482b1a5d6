"""The sockets of Moshi's protocol and GPT-Live on their own: what each sends for the
session's events, with a socket and a session that the test plays (the end-to-end tests,
tests/e2e/test_native_surfaces.py, run them against real processes).

Moshi: a session that ends before the handshake closes the socket with 1011 and its error
code (never a silent drop); an idle socket gets nothing after the handshake however long it
stays idle (no keepalive message: `moshi.server` sends none); the audio a client sends
before the handshake reaches the model after it, in order, up to a bound; the model's
frames go out as one Opus stream, silence included, with nothing padded in at a response's
end; an error that did not end the session does not make its later normal end a 1011.
GPT-Live: a model that never gets ready is given up with an error."""

from __future__ import annotations

import asyncio
import logging
import selectors
import types

import numpy as np
import orjson
import pytest
import sphn
from redis.exceptions import ConnectionError as RedisConnectionError

from services.api.command_sender import failure_event
from services.api.delivery import SessionParts
from services.api.door import Door
from services.api.inbox_writer import InboxFull
from services.api.live_sessions import LiveConnection
from services.api.metrics import ApiMetrics
from services.api.moshi_chat import (
    EARLY_MESSAGES,
    MoshiChatEndpoint,
    MoshiConnection,
    moshi_chat_path,
)
from services.api.ogg_opus import EncoderThread, OpusDecoder
from services.api.output_queue import OutItem, OutputQueue
from services.api.security import KeyChecker
from shared.protocol.duplex import MOSHI_AUDIO, AppendAudio

WAIT_S = 5


class Socket:
    """The client side the connection talks to: what it was sent, how it was closed."""

    def __init__(self) -> None:
        self.sent: list[bytes | str] = []
        self.closed: tuple[int, str] | None = None
        self.incoming: asyncio.Queue[dict] = asyncio.Queue()
        self.changed = asyncio.Event()

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)
        self.changed.set()

    async def send_text(self, data: str) -> None:
        self.sent.append(data)
        self.changed.set()

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = (code, reason)
        self.changed.set()
        await self.incoming.put({"type": "websocket.disconnect", "code": code})

    async def receive(self) -> dict:
        return await self.incoming.get()

    async def until(self, ok) -> None:
        async with asyncio.timeout(WAIT_S):
            while not ok():
                self.changed.clear()
                await self.changed.wait()


class Session:
    """The attachment and delivery: the test queues the session's events."""

    def __init__(self) -> None:
        self.queue = OutputQueue(1 << 20, 1000, 0, 0)
        self.session_id = "duplex-test"
        self.live = True
        self.released = False
        self.sent: list = []  # the commands the socket sent its session
        self.commands = types.SimpleNamespace(report=None)  # where an append's failure goes
        self.surface: str | None = None

    # the attachment's side
    def serve_surface(self, surface: str) -> None:
        self.surface = surface

    def created_delivered(self) -> None:
        pass

    async def release(self) -> None:
        self.released = True

    async def command(self, command) -> None:
        self.sent.append(command)

    # the delivery's side
    async def get(self) -> OutItem:
        return await self.queue.get()

    async def pump(self) -> None:
        await asyncio.Event().wait()

    async def drained(self) -> None:
        await self.queue.drained()

    def emit(self, wire_type: str, **body) -> None:
        self.queue.put(OutItem(orjson.dumps({"type": wire_type, **body}), wire_type))


#: the pod's encoder thread, one for the module's connections as one pod has one
ENCODER_THREAD = EncoderThread()


def moshi(session: Session, socket: Socket) -> MoshiConnection:
    parts = SessionParts(session, session, None)  # type: ignore[arg-type]
    return MoshiConnection(socket, parts, ApiMetrics(), WAIT_S, ENCODER_THREAD)  # type: ignore[arg-type]


async def test_a_session_that_ends_before_the_handshake_closes_with_its_error():
    session, socket = Session(), Socket()
    run = asyncio.create_task(moshi(session, socket).run())
    session.emit("error", error={"code": "runtime_data_plane_stream_failed", "message": "no"})
    session.emit("session.closed", reason="runtime_data_plane_stream_failed")
    async with asyncio.timeout(WAIT_S):
        await run
    assert socket.sent == []  # no handshake: the client never heard the model
    assert socket.closed == (1011, "runtime_data_plane_stream_failed")
    assert session.released


class JumpingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """A selector whose waits take no time: where nothing is ready it moves its clock on to
    the loop's next timer, so every timer fires in order at once (`JumpingClockLoop`)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None):  # type: ignore[override]
        ready = super().select(0)
        if not ready:
            if timeout is None:
                raise RuntimeError("nothing ready and no timer: the test would wait forever")
            self.now += timeout
        return ready


class JumpingClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock (`time`, which `asyncio.timeout` and `asyncio.sleep` read)
    jumps to its next timer whenever it would wait."""

    def __init__(self) -> None:
        self.selector = JumpingSelector()
        super().__init__(self.selector)

    def time(self) -> float:
        return self.selector.now


def test_an_idle_socket_gets_nothing_after_the_handshake():
    """The client sends nothing and the model has nothing to send: nothing is sent, however
    long (a minute on a clock that jumps: a timer the connection set, such as the old 5 s
    keepalive `0x02 0x00`, would fire and send). The pod's server pings the socket."""

    async def idle_minute() -> list[bytes | str]:
        session, socket = Session(), Socket()
        run = asyncio.create_task(moshi(session, socket).run())
        session.emit("session.started", session={"id": session.session_id})
        await socket.until(lambda: socket.sent == [b"\x00"])
        await asyncio.sleep(60)
        sent = list(socket.sent)
        await socket.incoming.put({"type": "websocket.disconnect", "code": 1000})
        async with asyncio.timeout(WAIT_S):
            await run
        return sent

    loop = JumpingClockLoop()
    try:
        sent = loop.run_until_complete(idle_minute())
        assert loop.time() >= 60  # the minute went by on the loop's clock
    finally:
        loop.close()
    assert sent == [b"\x00"]


class ClientFirst(Socket):
    """A client that sent its messages before the handshake: `asked` is set once the
    connection asks for one more than it sent (it has taken every one)."""

    def __init__(self, messages: list[bytes]) -> None:
        super().__init__()
        self.asked = asyncio.Event()
        for data in messages:
            self.incoming.put_nowait({"type": "websocket.receive", "bytes": data})

    async def receive(self) -> dict:
        if self.incoming.empty():
            self.asked.set()
        return await super().receive()


class Appended(Session):
    """A session that counts the appends it was sent."""

    def __init__(self) -> None:
        super().__init__()
        self.appended = asyncio.Event()

    async def command(self, command) -> None:
        await super().command(command)
        self.appended.set()

    async def until_appends(self, count: int) -> None:
        async with asyncio.timeout(WAIT_S):
            while len(self.sent) < count:
                self.appended.clear()
                await self.appended.wait()


def client_pages(count: int) -> list[bytes]:
    """A client's Ogg Opus stream of `count` 80 ms frames, each sounding different, one
    page a message (the first carries the headers)."""
    writer = sphn.OpusStreamWriter(24000)
    t = np.arange(1920) / 24000
    return [
        b"\x01" + writer.append_pcm((0.3 * np.sin(2 * np.pi * (200 + 40 * i) * t)).astype("f4"))
        for i in range(count)
    ]


@pytest.mark.parametrize("early", [5, EARLY_MESSAGES + 7])
async def test_audio_sent_before_the_handshake_reaches_the_model_after_it(early, caplog):
    """What a client sends before the handshake (moshi's command-line client sends from the
    connect) is appended after it, in order, then what it sends next; past the bound the
    later ones are dropped and said once, and the stream still decodes after the gap."""
    pages = client_pages(early + 1)
    session, socket = Appended(), ClientFirst(pages[:early])
    run = asyncio.create_task(moshi(session, socket).run())
    async with asyncio.timeout(WAIT_S):
        await socket.asked.wait()  # every early message read, the model not ready yet
    assert session.sent == []
    session.emit("session.started", session={"id": session.session_id})
    await socket.until(lambda: socket.sent == [b"\x00"])
    await socket.incoming.put({"type": "websocket.receive", "bytes": pages[early]})
    kept = min(early, EARLY_MESSAGES)
    await session.until_appends(kept + 1)

    decoder = OpusDecoder()
    heard = [decoder.decode(page[1:]) for page in [*pages[:kept], pages[early]]]
    assert all(isinstance(c, AppendAudio) for c in session.sent)
    assert [c.audio for c in session.sent] == heard
    assert {(c.format, c.sample_rate_hz) for c in session.sent} == {("pcm16", 24000)}
    dropped = [r for r in caplog.records if "dropped before the handshake" in r.getMessage()]
    assert len(dropped) == (1 if early > EARLY_MESSAGES else 0)
    assert all(r.levelno == logging.WARNING for r in dropped)
    await socket.incoming.put({"type": "websocket.disconnect", "code": 1000})
    async with asyncio.timeout(WAIT_S):
        await run


def audio_record(samples: np.ndarray) -> OutItem:
    """A moshi session's audio as it crosses Redis: the step's pcm16 bytes, not JSON."""
    return OutItem((samples * 32767).astype("<i2").tobytes(), MOSHI_AUDIO)


async def test_the_models_frames_are_one_stream_with_nothing_padded_at_a_responses_end():
    """A frame out for every step's record, silence included; a response's end sends
    nothing (a padded partial frame would put samples in the stream that the model never
    made): a partial frame waits for the rest."""
    session, socket = Session(), Socket()
    run = asyncio.create_task(moshi(session, socket).run())
    session.emit("session.started", session={"id": session.session_id})
    session.queue.put(audio_record(np.zeros(1920, np.float32)))  # the model listens
    session.queue.put(audio_record(np.full(1920, 0.3, np.float32)))  # it speaks
    session.emit("response.done", response={"status": "completed"})
    session.queue.put(audio_record(np.zeros(1920, np.float32)))
    session.queue.put(audio_record(np.full(1920 * 3 // 2, 0.3, np.float32)))
    session.emit("response.done", response={"status": "completed"})
    session.queue.put(audio_record(np.full(1920 // 2, 0.3, np.float32)))
    session.emit("response.done", response={"status": "completed"})
    session.emit("session.closed", reason="client_close")
    async with asyncio.timeout(WAIT_S):
        await run
    assert socket.sent[0] == b"\x00"
    assert all(isinstance(m, bytes) and m[0] == 0x01 for m in socket.sent[1:])
    reader = sphn.OpusStreamReader(24000)
    heard = [reader.append_bytes(m[1:]).size for m in socket.sent[1:]]
    assert heard == [1920] * 5  # 5 frames in (the last two as 1.5 + 0.5), 5 out


async def test_an_error_the_session_outlived_leaves_its_end_normal():
    session, socket = Session(), Socket()
    run = asyncio.create_task(moshi(session, socket).run())
    session.emit("session.started", session={"id": session.session_id})
    session.emit("error", error={"code": "input_backpressure", "message": "slow down"})
    session.queue.put(audio_record(np.full(1920, 0.3, np.float32)))
    session.emit("response.output_audio_transcript.delta", delta="hi")
    session.emit("response.done", response={"status": "completed"})
    session.emit("session.closed", reason="timeout")
    async with asyncio.timeout(WAIT_S):
        await run
    assert socket.closed == (1000, "timeout")
    kinds = [m[0] for m in socket.sent if isinstance(m, bytes)]
    assert kinds == [0x00, 0x01, 0x02]  # handshake, a frame, words
    assert socket.sent[2] == b"\x02hi"


async def test_a_gpt_live_model_that_never_gets_ready_is_given_up(monkeypatch):
    session, socket = Session(), Socket()
    parts = SessionParts(session, session, None)  # type: ignore[arg-type]
    connection = LiveConnection(
        socket,  # type: ignore[arg-type]
        parts,
        ApiMetrics(),
        1 << 20,
        config_timeout_s=1,
        ready_timeout_s=0.1,
    )

    async def opened(timeout_s: float) -> bool:
        return True  # session.start was taken: now the model's session.started is awaited

    monkeypatch.setattr(connection, "_start", opened)
    async with asyncio.timeout(WAIT_S):
        await connection.run()
    (error,) = [orjson.loads(m) for m in socket.sent]
    assert error["type"] == "error" and error["error"]["code"] == "timeout"
    assert socket.closed is not None and socket.closed[0] == 1000
    assert session.released


class Opening(Session):
    """An attachment whose open succeeds (or raises `fails`), for the door's tests."""

    def __init__(self, fails: BaseException | None = None) -> None:
        super().__init__()
        self.fails = fails

    async def open(self, session: dict, default_model) -> dict:
        if self.fails is not None:
            raise self.fails
        return {"type": "session.created", "session": {"id": self.session_id}}

    def created(self, reply: dict) -> None:
        self.queue.put(OutItem(orjson.dumps(reply), "session.created"))


class GoneBeforeTheUpgrade(Socket):
    """A client that left while its upgrade waited for a slot."""

    def __init__(self) -> None:
        super().__init__()
        self.scope = {"type": "websocket", "path": "/api/chat", "headers": [], "query_string": b""}

    async def accept(self, subprotocol=None) -> None:
        raise OSError("the client is gone")


@pytest.mark.parametrize("fails", [None, ConnectionError("Redis is gone")])
async def test_a_session_opened_for_a_client_that_left_is_released(fails):
    """The open succeeded (after a wait for a slot) but the client had left: the upgrade
    fails, and the session must not keep the slot. Likewise an open that fails midway."""
    session = Opening(fails)
    endpoint = MoshiChatEndpoint(
        Door(KeyChecker(()), frozenset()),
        ApiMetrics(),
        lambda key: SessionParts(session, session, None),  # type: ignore[arg-type]
        admission_wait_s=1,
        handshake_timeout_s=1,
    )
    with pytest.raises((OSError, ConnectionError)):
        await endpoint(GoneBeforeTheUpgrade(), None)  # type: ignore[arg-type]
    assert session.released


def test_the_key_of_a_moshi_path_is_read_as_the_server_decoded_it():
    assert moshi_chat_path("/api/chat") == ""
    assert moshi_chat_path("/key/k-1%/api/chat") == "k-1%"  # not decoded a second time
    assert moshi_chat_path("/key//api/chat") is None
    assert moshi_chat_path("/key/a/b/api/chat") is None
    assert moshi_chat_path("/v1/realtime") is None


async def test_an_appends_failure_reaches_a_gpt_live_client_in_gpt_lives_words():
    """An append is not awaited: its failure comes back later, through the attachment's
    report, which the socket driver points at the protocol's refusal."""
    session, socket = Session(), Socket()
    parts = SessionParts(session, session, None)  # type: ignore[arg-type]
    LiveConnection(
        socket,  # type: ignore[arg-type]
        parts,
        ApiMetrics(),
        1 << 20,
        config_timeout_s=1,
        ready_timeout_s=1,
    )
    assert session.surface == "live"
    session.commands.report(failure_event(InboxFull("full"), "append-7"))
    item = await session.get()
    error = orjson.loads(item.data)["error"]
    assert (error["code"], error["client_event_id"]) == ("input_backpressure", "append-7")
    assert "event_id" not in error and "retryable" not in error  # GPT-Live's shape


async def test_a_message_that_needs_redis_while_it_fails_over_costs_the_client_nothing_more(
    caplog,
):
    """A message whose handling meets Redis away (an ack, a command awaited; here the
    first audio message): its refusal is said and the socket lives on, where the socket
    driver took it for a bug and dropped the socket. The next message goes through."""
    pages = client_pages(2)
    session, socket = Appended(), Socket()
    connection = moshi(session, socket)
    handle = connection.on_message
    failed = False

    async def once_away(message):
        nonlocal failed
        if not failed:
            failed = True
            raise RedisConnectionError("No master found for 'duplex'")
        return await handle(message)

    connection.on_message = once_away  # type: ignore[method-assign]
    run = asyncio.create_task(connection.run())
    session.emit("session.started", session={"id": session.session_id})
    await socket.until(lambda: socket.sent == [b"\x00"])
    with caplog.at_level(logging.WARNING):
        for page in pages:
            await socket.incoming.put({"type": "websocket.receive", "bytes": page})
        await session.until_appends(1)
    assert socket.closed is None and failed
    assert any("input dropped: internal_error" in r.getMessage() for r in caplog.records)
    await socket.incoming.put({"type": "websocket.disconnect", "code": 1000})
    async with asyncio.timeout(WAIT_S):
        await run
