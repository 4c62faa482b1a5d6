"""`duplex serve` on its own, and API keys."""

import httpx
import orjson
import pytest
import websockets

from harness.processes import start_serve
from shared.client.duplex_client import DuplexClient, realtime_url

KEY = "sk-test-123"


def test_serve_says_where_it_listens_and_exits_on_sigterm(serve):
    assert httpx.get(f"{serve.base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{serve.base}/health/ready").json() == {"ready": True, "reason": "ok"}
    assert f"http://127.0.0.1:{serve.port}" in serve.logs() and "Redis: embedded" in serve.logs()
    metrics = httpx.get(f"{serve.base}/metrics").text
    assert (
        "duplex_active_websocket_sessions" in metrics and "duplex_command_seconds_bucket" in metrics
    )


def test_serve_stops_cleanly():
    process = start_serve("serve-stop")
    process.wait_ready()
    assert process.stop() == 0


@pytest.fixture(scope="module")
def keyed():
    process = start_serve(
        "serve-keys", DUPLEX_API_KEYS=f"other-key,{KEY}", DUPLEX_CONFIG_TIMEOUT_S="0.5"
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def test_http_routes_need_the_key(keyed):
    assert httpx.get(f"{keyed.base}/health").status_code == 200  # health stays open for probes
    assert httpx.get(f"{keyed.base}/v1/models").status_code == 401
    wrong = httpx.get(f"{keyed.base}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.get(f"{keyed.base}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def test_the_console_page_is_served_without_a_key(keyed):
    """The page is static and public; everything it does goes through /v1 with the key."""
    page = httpx.get(f"{keyed.base}/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    for asset in ("console.js", "worklets.js", "console.css"):
        assert f"/console/{asset}" in page.text or asset == "worklets.js"
        reply = httpx.get(f"{keyed.base}/console/{asset}")
        assert reply.status_code == 200 and len(reply.content) > 500, asset
    assert 'registerProcessor("capture"' in httpx.get(f"{keyed.base}/console/worklets.js").text


async def test_websocket_needs_the_key_before_any_session(keyed):
    with pytest.raises(websockets.InvalidStatus) as info:
        async with websockets.connect(realtime_url(keyed.base)):
            pass
    assert info.value.response.status_code == 401  # as every route's door refuses a bad key
    client = DuplexClient([keyed.base], api_key=KEY, heartbeat_s=None)
    await client.connect({"extra_body": {"pace": 0}})
    await client.close()
    # browsers cannot set headers: the key rides in a subprotocol (or ?api_key=)
    protocols = ["realtime", f"openai-insecure-api-key.{KEY}"]
    async with websockets.connect(realtime_url(keyed.base), subprotocols=protocols) as ws:
        await ws.send('{"type":"session.update","session":{}}')
        assert orjson.loads(await ws.recv())["type"] == "session.created"
    async with websockets.connect(realtime_url(keyed.base) + f"&api_key={KEY}") as ws:
        await ws.send('{"type":"session.update","session":{}}')
        assert orjson.loads(await ws.recv())["type"] == "session.created"


async def test_handshake_rules(serve):
    async with websockets.connect(f"ws://127.0.0.1:{serve.port}/v1/realtime?duplex=maybe") as ws:
        reply = orjson.loads(await ws.recv())
        assert (reply["error"]["code"], reply["error"]["param"]) == (
            "invalid_session_config",
            "duplex",
        )
    async with websockets.connect(f"ws://127.0.0.1:{serve.port}/v1/duplex?model=echo") as ws:
        created = orjson.loads(await ws.recv())  # ?model= with autostart opens before any message
        assert created["type"] == "session.created" and created["session"]["model"] == "echo"
        assert created["attachment_generation"] == 1 and len(created["resume_token"]) >= 40
    async with websockets.connect(
        f"ws://127.0.0.1:{serve.port}/v1/realtime?duplex=1&autostart=0"
    ) as ws:
        await ws.send('{"type":"session.heartbeat","event_id":"h1"}')
        reply = orjson.loads(await ws.recv())
        assert (
            reply["error"]["code"] == "invalid_session_config"
            and reply["error"]["event_id"] == "h1"
        )
    async with websockets.connect(f"ws://127.0.0.1:{serve.port}/v1/realtime?duplex=1") as ws:
        await ws.send('{"type":"session.heartbeat"}')  # any other first event autostarts
        kinds = [orjson.loads(await ws.recv())["type"] for _ in range(3)]
        assert kinds == ["session.created", "session.updated", "session.heartbeat_ack"]
        await ws.send('{"type":"response.cancel"}')  # the worker's error counts too
        assert orjson.loads(await ws.recv())["error"]["code"] == "response_not_active"
    metrics = httpx.get(f"{serve.base}/metrics").text
    assert 'duplex_errors_total{code="invalid_session_config"}' in metrics
    assert 'duplex_errors_total{code="response_not_active"}' in metrics


async def test_config_timeout(keyed):
    async with websockets.connect(realtime_url(keyed.base) + f"&api_key={KEY}") as ws:
        reply = orjson.loads(await ws.recv())  # we send nothing
        assert reply["error"]["code"] == "config_timeout"
        await ws.wait_closed()
