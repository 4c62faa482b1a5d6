"""What an idle Realtime socket keeps in the API pod: uvicorn's protocol without the
handshake's headers and idle queues (services/api/ws_protocol.py), and the sockets served
at the app's door, past the router (services/api/app.py, realtime.py)."""

import asyncio
import functools

import pytest
import uvicorn
import websockets
from fastapi import WebSocket
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse

from harness.redis_server import free_port
from services.api.app import DuplexApp
from services.api.door import Door
from services.api.http_guard import GuardedH11Protocol
from services.api.metrics import ApiMetrics
from services.api.realtime import RealtimeEndpoint, realtime_route
from services.api.security import KeyChecker
from services.api.socket_driver import SocketEndpoint
from services.api.waitables import Flag, Mailbox
from services.api.ws_protocol import LeanWebSocketProtocol


async def echo_app(scope, receive, send):
    assert scope["type"] == "websocket"
    assert (await receive())["type"] == "websocket.connect"
    await send({"type": "websocket.accept"})
    while (message := await receive())["type"] == "websocket.receive":
        await send({"type": "websocket.send", "text": message["text"].upper()})


async def test_an_open_socket_keeps_no_handshake_headers_and_still_talks():
    config = uvicorn.Config(
        echo_app,
        host="127.0.0.1",
        port=free_port(),
        http=functools.partial(GuardedH11Protocol, header_timeout_s=5.0),
        ws="websockets-sansio",
        lifespan="off",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None
    serving = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:  # the listening socket is up
                await asyncio.sleep(0.01)
        url = f"ws://127.0.0.1:{config.port}/"
        async with websockets.connect(url, additional_headers={"x-big": "v" * 2000}) as ws:
            await ws.send("hello")
            assert await ws.recv() == "HELLO"
            (protocol,) = [
                p for p in server.server_state.connections if p.__class__ is not GuardedH11Protocol
            ]
            assert isinstance(protocol, LeanWebSocketProtocol)
            assert protocol.request is None and protocol.response is None
            assert isinstance(protocol.queue, Mailbox) and protocol.queue.empty()
            assert isinstance(protocol.writable, Flag) and protocol.writable.is_set()
            await ws.send("again")  # the socket works on after the drop
            assert await ws.recv() == "AGAIN"
    finally:
        server.should_exit = True
        await serving


class FakeConnection:
    def __init__(self, websocket: WebSocket, **options) -> None:
        self.websocket, self.options = websocket, options
        self.surface = None

    def use_surface(self, surface: str) -> None:
        self.surface = surface

    async def run(self) -> None:
        headers_left = len(self.websocket.scope["headers"])
        await self.websocket.send_json(
            {"surface": self.surface, "headers_left": headers_left, **self.options}
        )
        await self.websocket.close()


def door_app() -> tuple[DuplexApp, list[str]]:
    endpoint = RealtimeEndpoint(Door(KeyChecker(["k1"]), frozenset()), ApiMetrics(), FakeConnection)
    app = DuplexApp()
    app.socket_endpoints = (endpoint,)
    routed: list[str] = []

    @app.websocket("/v1/realtime")
    async def via_router(websocket: WebSocket) -> None:  # the door serves this path first
        routed.append("router")
        await websocket.close()

    @app.websocket("/other")
    async def other(websocket: WebSocket) -> None:
        routed.append("other")
        await websocket.accept()
        await websocket.send_json({"other": True})
        await websocket.close()

    return app, routed


def test_realtime_sockets_are_served_at_the_door_and_drop_their_request_headers():
    app, routed = door_app()
    client = TestClient(app)
    with client.websocket_connect("/v1/duplex?model=m&api_key=k1") as ws:
        reply = ws.receive_json()
    assert reply["surface"] == "duplex" and reply["model"] == "m" and reply["api_key"] == "k1"
    assert reply["headers_left"] == 0  # read at the door, then dropped
    with client.websocket_connect("/v1/realtime", headers={"authorization": "Bearer k1"}) as ws:
        assert ws.receive_json()["surface"] == "openai"
    with client.websocket_connect("/other") as ws:
        assert ws.receive_json() == {"other": True}
    assert routed == ["other"]  # the router never saw a Realtime socket


class FifthProtocol(SocketEndpoint):
    """A protocol the pod does not have: registered, its paths are served at the door."""

    def match(self, path: str):
        return (path.rsplit("/", 1)[-1],) if path.startswith("/v1/fifth/") else None

    async def __call__(self, websocket: WebSocket, name: str) -> None:  # type: ignore[override]
        await websocket.accept()
        await websocket.send_json({"protocol": "fifth", "name": name})
        await websocket.close()


def test_a_protocol_is_served_by_registering_its_endpoint():
    app, routed = door_app()
    app.socket_endpoints = (*app.socket_endpoints, FifthProtocol())
    client = TestClient(app)
    with client.websocket_connect("/v1/fifth/hello") as ws:
        assert ws.receive_json() == {"protocol": "fifth", "name": "hello"}
    with client.websocket_connect("/v1/duplex?api_key=k1") as ws:  # the others still theirs
        assert ws.receive_json()["surface"] == "duplex"
    assert routed == []


def test_the_door_still_refuses_a_missing_key_before_accept():
    """With HTTP 401 and OpenAI's error body, as every route's door (door.py) and OpenAI's
    own Realtime endpoint refuse a bad key: no session exists."""
    app, _ = door_app()
    client = TestClient(app)
    with (
        pytest.raises(WebSocketDenialResponse) as refused,
        client.websocket_connect("/v1/realtime"),
    ):
        raise AssertionError("accepted without a key")
    assert refused.value.status_code == 401
    assert refused.value.json()["error"]["code"] == "invalid_api_key"


def test_realtime_route_matches_below_the_root_path_and_only_websockets():
    scope = {"type": "websocket", "path": "/api/v1/duplex", "root_path": "/api"}
    assert realtime_route(scope) is True
    assert realtime_route({"type": "websocket", "path": "/v1/realtime"}) is False
    assert realtime_route({"type": "http", "path": "/v1/realtime"}) is None
    assert realtime_route({"type": "websocket", "path": "/v1/realtime/"}) is None
