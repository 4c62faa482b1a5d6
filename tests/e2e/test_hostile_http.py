"""Issue 14 against real processes: the API pod's HTTP surface cannot be frozen, flooded
or crashed. A redis-server, a `duplex worker` and a `duplex api` (no API keys, 1 s head
deadline); a keyed `duplex serve` with a tiny connection limit; a `duplex serve` whose
Redis dies. Waits are on observable things (a socket's EOF, a status), never on time."""

import asyncio
import socket
import uuid
from pathlib import Path

import httpx
import orjson
import pytest
import websockets

from harness.processes import start_api, start_serve, start_worker
from harness.redis_server import RedisServer, free_port
from harness.sockets import closed_by_server
from shared.client.duplex_client import realtime_url

KEY = "sk-hostile-1"
LISTED_ORIGIN = "https://app.example"
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def pod(redis_server):
    prefix = f"duplex-hostile-{uuid.uuid4().hex[:8]}"
    health_port = free_port()
    worker = start_worker(
        redis_server.url, prefix, "hostile-worker", DUPLEX_WORKER_HEALTH_PORT=str(health_port)
    )
    api = start_api(
        redis_server.url,
        prefix,
        "api-hostile",
        DUPLEX_HEADER_TIMEOUT_S="1",
        DUPLEX_ALLOWED_ORIGINS=LISTED_ORIGIN,
    )
    try:
        api.wait_ready()
        api.worker_health = f"http://127.0.0.1:{health_port}"
        yield api
    finally:
        api.stop()
        worker.stop()


@pytest.fixture(scope="module")
def keyed():
    process = start_serve("serve-hostile-keys", DUPLEX_API_KEYS=KEY, DUPLEX_LIMIT_CONCURRENCY="3")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def chat_body(size: int, stream: bool = True) -> bytes:
    words = " ".join(["a"] * (size // 2))
    message = {"role": "user", "content": words}
    return orjson.dumps({"model": "echo", "stream": stream, "messages": [message]})


# ---------------------------------------------------------------- chat completions


def test_a_3_mib_chat_body_gets_413_streamed_or_declared(pod):
    body = chat_body(3 * MIB)

    def chunks():
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    with httpx.Client(base_url=pod.base, timeout=60) as http:
        for content in (chunks(), body):  # chunked transfer (no length), then Content-Length
            reply = http.post("/v1/chat/completions", content=content)
            assert reply.status_code == 413
            assert reply.json()["error"]["code"] == "request_too_large"
        assert http.get("/health").status_code == 200


async def test_a_large_allowed_streamed_reply_is_bounded_and_leaves_the_loop_free(pod):
    body = chat_body(MIB - 4096)  # just under chat_max_body_bytes
    events: list[bytes] = []
    async with (
        httpx.AsyncClient(base_url=pod.base, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", content=body) as stream,
    ):
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        while not events:  # the first SSE event, then the client stops reading
            if line := await anext(lines):
                events.append(line.encode())
        async with httpx.AsyncClient(base_url=pod.base, timeout=60) as probe:
            assert (await probe.get("/health")).status_code == 200  # answered meanwhile
        async for line in lines:
            if line:
                events.append(line.encode())
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content.startswith("echo: a a a") and len(content) == 64 * 1024  # the reply cap
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) <= 2 + 64 * 1024 // 128  # batches of words, not one chunk a word
    metrics = httpx.get(f"{pod.base}/metrics").text
    assert "duplex_event_loop_lag_seconds_count" in metrics


def test_the_worker_serves_its_loop_lag_on_its_health_port(pod):
    metrics = httpx.get(f"{pod.worker_health}/metrics")
    assert metrics.status_code == 200
    assert "duplex_event_loop_lag_seconds_bucket" in metrics.text


# ---------------------------------------------------------------- connections


async def test_idle_and_half_sent_connections_are_closed_by_the_server(pod):
    connections = [await asyncio.open_connection("127.0.0.1", pod.port) for _ in range(40)]
    for _, writer in connections[::2]:
        writer.write(b"GET /health HT")  # half a request line; the others send nothing
    received = await asyncio.gather(*(closed_by_server(r) for r, _ in connections))
    assert received == [b""] * len(connections)
    for _, writer in connections:
        writer.close()
    assert httpx.get(f"{pod.base}/health").status_code == 200


async def test_past_the_connection_limit_requests_and_upgrades_get_a_clear_503(keyed):
    url = realtime_url(keyed.base) + f"&api_key={KEY}"
    async with websockets.connect(url) as first, websockets.connect(url) as second:
        await first.send('{"type":"session.update","session":{}}')
        assert orjson.loads(await first.recv())["type"] == "session.created"
        auth = {"Authorization": f"Bearer {KEY}"}
        refused = httpx.get(f"{keyed.base}/v1/models", headers=auth)  # 3 connections: the limit
        assert (refused.status_code, refused.text) == (503, "Service Unavailable")
        probe = httpx.get(f"{keyed.base}/health")  # the probes are answered past the limit
        assert probe.status_code == 200
        with pytest.raises(websockets.InvalidStatus) as upgrade:
            async with websockets.connect(url):
                pass
        assert upgrade.value.response.status_code == 503
        await second.send('{"type":"session.update","session":{}}')
        assert orjson.loads(await second.recv())["type"] == "session.created"
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
        while (await http.get(f"{keyed.base}/v1/models")).status_code != 200:
            await asyncio.sleep(0.05)  # until the server has seen both sockets close


# ---------------------------------------------------------------- keys and origins


def test_a_non_ascii_key_gets_401_never_500(keyed):
    for headers, params in (
        ({"Authorization": "Bearer clé-été".encode()}, {}),  # raw UTF-8 bytes on the wire
        ({}, {"api_key": "clé-été"}),
    ):
        for method, path in (
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/v1/chat/completions"),
        ):
            reply = httpx.request(
                method, f"{keyed.base}{path}", headers=headers, params=params, content=b"{}"
            )
            assert reply.status_code == 401, (path, reply.text)
            assert reply.json()["error"]["code"] == "invalid_api_key"
    assert "Traceback" not in keyed.logs()


async def test_a_non_ascii_key_on_a_websocket_is_refused_before_accept(keyed):
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(realtime_url(keyed.base) + "&api_key=cl%C3%A9"):
            pass
    assert refused.value.response.status_code == 401  # refused before accept (door.py)
    with socket.create_connection(("127.0.0.1", keyed.port)) as raw:
        raw.sendall(
            b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer cl\xc3\xa9\r\n\r\n"
        )
        assert raw.recv(100).startswith(b"HTTP/1.1 401")
    assert "Traceback" not in keyed.logs()


async def opens_a_session(url: str, origin: str | None, refused_with: int = 403) -> bool:
    try:
        async with websockets.connect(url, origin=origin) as ws:
            await ws.send('{"type":"session.update","session":{}}')
            return orjson.loads(await ws.recv())["type"] == "session.created"
    except websockets.InvalidStatus as refused:
        assert refused.response.status_code == refused_with
        return False


async def test_websocket_origins_without_keys(pod):
    url = realtime_url(pod.base)
    assert await opens_a_session(url, None)  # not a browser
    assert await opens_a_session(url, f"http://127.0.0.1:{pod.port}")  # the pod's console
    assert await opens_a_session(url, LISTED_ORIGIN)  # DUPLEX_ALLOWED_ORIGINS
    assert not await opens_a_session(url, "https://evil.example")
    assert not await opens_a_session(url, "null")


async def test_with_keys_the_key_is_the_credential_whatever_the_origin(keyed):
    url = realtime_url(keyed.base)
    assert await opens_a_session(url + f"&api_key={KEY}", "https://any.example")
    assert not await opens_a_session(url, "https://any.example", refused_with=401)  # no key


# ---------------------------------------------------------------- what the pod tells anyone


def test_no_openapi_schema_and_console_security_headers(pod):
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{pod.base}{path}").status_code == 404
    for path in ("/", "/console/console.js", "/console/worklets.js", "/console/console.css"):
        headers = httpx.get(f"{pod.base}{path}").headers
        assert headers["x-frame-options"] == "DENY"
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["referrer-policy"] == "no-referrer"
        policy = headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "script-src 'self';" in policy
        assert f"ws://127.0.0.1:{pod.port}" in policy


async def test_readiness_says_redis_is_unreachable_and_nothing_more():
    server = RedisServer()
    process = start_serve("serve-hostile-ready", DUPLEX_REDIS_URL=server.url)
    try:
        process.wait_ready()
        server.kill()
        async with httpx.AsyncClient() as http:
            while (reply := await http.get(f"{process.base}/health/ready")).status_code != 503:
                await asyncio.sleep(0.05)  # until the pod has noticed
        assert reply.json() == {"ready": False, "reason": "redis unreachable"}
        assert str(server.port) not in reply.text and "127.0.0.1" not in reply.text
        # the detail is for operators, in the pod's log
        logged = [line for line in process.logs().splitlines() if "not ready:" in line]
        assert logged and f"127.0.0.1:{server.port}" in logged[0]
    finally:
        process.stop()
        server.stop()


def until(page, expression: str, timeout_s: float = 30) -> None:
    """Poll a page expression with evaluate(): Playwright's wait_for_function runs string
    predicates through the page's eval(), which the console's policy forbids."""
    for _ in range(int(timeout_s / 0.1)):
        if page.evaluate(expression):
            return
        page.wait_for_timeout(100)  # polling the page's observable state
    raise AssertionError(f"never true: {expression}")


def test_the_console_runs_under_its_policy_and_origin_rule(pod, tmp_path):
    """Real Chromium, no API keys: the page, its worklet and its WebSocket (same-host
    Origin) all work under the Content-Security-Policy, and nothing is reported blocked."""
    from tests.e2e.test_console import CHROMIUM, FLAGS, microphone_wav

    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is missing (make test installs it)")
    from playwright.sync_api import sync_playwright

    microphone = microphone_wav(tmp_path / "microphone.wav")
    flags = [*FLAGS, f"--use-file-for-fake-audio-capture={microphone}"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=flags)
        try:
            page = browser.new_page()
            messages: list[str] = []
            page.on("console", lambda message: messages.append(message.text))
            page.goto(pod.base + "/")
            until(page, "document.querySelector('#model').options.length > 0")
            page.click("#connect")  # worklet module + WebSocket with the page's Origin
            until(page, "window.consoleState.sessionId !== null")
            state = page.evaluate("window.consoleState")
            assert state["sessionId"].startswith("duplex-") and state["errors"] == []
            assert page.evaluate("window.consoleAudio.micContext.state") == "running"
        finally:
            browser.close()
    assert not [m for m in messages if "Content Security Policy" in m], messages
