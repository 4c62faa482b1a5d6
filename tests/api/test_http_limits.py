"""The API pod's uvicorn server (services/serve.py + services/api/http_guard.py) on a
tiny ASGI app: request heads have a deadline, WebSocket upgrades obey limit_concurrency.

Every wait is on something observable (a socket's EOF, an app's event), never on time:
a socket that must stay open is checked after another one, opened later, was closed
by the same deadline."""

import asyncio
import contextlib

import pytest
import websockets

from harness.redis_server import free_port
from harness.sockets import closed_by_server
from services.serve import _uvicorn_server
from shared.settings import ApiSettings

HEADER_TIMEOUT_S = 0.5
#: generous bound for "the server closes it": reached only when the deadline is broken


class App:
    """/slow answers once `release` is set; /ws echoes; /refuse answers 413 unread."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.slow_started = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            while (message := await receive())["type"] == "websocket.receive":
                await send({"type": "websocket.send", "text": message.get("text")})
            return
        if scope["path"] == "/slow":
            self.slow_started.set()
            await self.release.wait()
        status = 413 if scope["path"] == "/refuse" else 200
        headers = [(b"content-length", b"4")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"done"})


@pytest.fixture
async def server():
    app = App()
    settings = ApiSettings(
        port=free_port(), header_timeout_s=HEADER_TIMEOUT_S, limit_concurrency=3, keep_alive_s=60
    )
    uvicorn_server = _uvicorn_server(app, settings)
    task = asyncio.create_task(uvicorn_server.serve())
    while not uvicorn_server.started:
        await asyncio.sleep(0.01)  # polling the observable start, not ordering by time
    yield app, settings.port
    uvicorn_server.should_exit = True
    app.release.set()
    await task


async def test_silent_and_half_sent_requests_are_closed(server):
    _, port = server
    sockets = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    sockets[1][1].write(b"GET /hea")  # half a request line
    sockets[2][1].write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # headers never ended
    for reader, writer in sockets:
        assert await closed_by_server(reader) == b""
        writer.close()


async def test_a_trickled_head_does_not_extend_the_deadline(server):
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    closed = asyncio.create_task(closed_by_server(reader))
    sent = 0
    while not closed.done() and sent < 1000:  # one byte every 50 ms: the slowloris
        with contextlib.suppress(ConnectionError):
            writer.write(b"a")
            await writer.drain()
        sent += 1
        await asyncio.wait([closed], timeout=0.05)
    assert closed.done() and await closed == b""
    writer.close()


async def test_a_kept_alive_connection_gets_the_same_deadline_between_requests(server):
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await reader.readuntil(b"done")).startswith(b"HTTP/1.1 200")
    writer.write(b"GET / HT")  # keep_alive_s is 60 s; the head deadline still applies
    assert await closed_by_server(reader) == b""
    writer.close()


async def test_requests_and_websockets_in_progress_are_not_cut(server):
    app, port = server
    busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
    busy_writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    await app.slow_started.wait()
    async with websockets.connect(f"ws://127.0.0.1:{port}/ws") as ws:
        # a silent socket opened after both: once it is closed, theirs deadline is past too
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        assert await closed_by_server(idle_reader) == b""
        idle_writer.close()
        await ws.send("still here")
        assert await ws.recv() == "still here"
    app.release.set()
    assert (await busy_reader.readuntil(b"done")).startswith(b"HTTP/1.1 200")
    busy_writer.close()


async def test_a_refused_body_is_drained_for_one_deadline_only(server):
    _, port = server
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: 10485760\r\n\r\n")
    writer.write(b"x" * 65536)  # then nothing: the rest of the 10 MiB never comes
    received = await closed_by_server(reader)
    assert received.startswith(b"HTTP/1.1 413")
    writer.close()


async def test_websocket_upgrades_past_the_limit_get_503(server):
    _, port = server
    url = f"ws://127.0.0.1:{port}/ws"
    async with websockets.connect(url) as first, websockets.connect(url) as second:
        # limit_concurrency=3 counts the connection asking: two open, the third is refused
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url):
                pass
        assert refused.value.response.status_code == 503
        assert refused.value.response.body == b"Service Unavailable"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await closed_by_server(reader)).startswith(b"HTTP/1.1 503")  # plain HTTP too
        writer.close()
        # the probes are answered past the limit: a full pod is not restarted by its
        # liveness probe (which would drop every session on it)
        for probe in (b"/health", b"/health/ready"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET " + probe + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await closed_by_server(reader)).startswith(b"HTTP/1.1 200")
            writer.close()
        for ws in (first, second):
            await ws.send("served")
            assert await ws.recv() == "served"
