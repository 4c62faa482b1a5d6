"""Chat completions' bounds (services/api/chat.py): the body is refused while it is read,
the reply is cut into few chunks, and the stream gives the loop a turn per chunk, so a
client that leaves stops it. tests/e2e/test_hostile_http.py runs the same against real
processes."""

import asyncio

import orjson
import pytest
from starlette.requests import Request
from starlette.responses import StreamingResponse

from services.api.chat import (
    CHUNK_CHARS,
    CHUNK_WORDS,
    BodyTooLarge,
    deltas,
    openai_error,
    read_body,
    sse_stream,
)

LIMIT = 1024 * 1024


def request(headers: dict[str, str], chunks: list[bytes] | None, received: list[int]) -> Request:
    """A request whose body arrives in `chunks` (None: an endless body)."""

    async def receive():
        received.append(1)
        if chunks is None:
            return {"type": "http.request", "body": b"x" * 65536, "more_body": True}
        body = chunks.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    return Request(scope, receive)


async def test_a_declared_length_past_the_limit_is_refused_unread():
    received: list[int] = []
    with pytest.raises(BodyTooLarge):
        await read_body(request({"Content-Length": str(10 * LIMIT)}, None, received), LIMIT)
    assert received == []


async def test_a_streamed_body_is_counted_and_refused_once_past_the_limit():
    received: list[int] = []
    with pytest.raises(BodyTooLarge):
        await read_body(request({}, None, received), LIMIT)
    assert len(received) == LIMIT // 65536 + 1  # never one chunk more than needed


async def test_a_body_within_the_limit_is_read_whole():
    received: list[int] = []
    body = await read_body(request({}, [b"ab", b"cd", b""], received), LIMIT)
    assert body == b"abcd"


def test_deltas_rebuild_the_text_in_bounded_pieces():
    texts = [
        "",
        "hello",
        "hello world, how are you",
        " leading and trailing  double  spaces ",
        " ".join(["a"] * 1000),
        " ".join(["word"] * 300),
        "x" * 5000 + " tail " + "y" * 1500,
    ]
    for text in texts:
        pieces = list(deltas(text))
        assert "".join(pieces) == text
        assert all(len(p) <= CHUNK_CHARS and p.count(" ") <= CHUNK_WORDS for p in pieces)
    assert len(list(deltas(" ".join(["a"] * 1000)))) == -(-1000 // CHUNK_WORDS)
    assert len(list(deltas("x" * 5000))) == 5


def test_errors_have_openais_shape():
    reply = openai_error(413, "too large", "request_too_large")
    assert reply.status_code == 413
    assert orjson.loads(reply.body) == {
        "error": {
            "message": "too large",
            "type": "invalid_request_error",
            "code": "request_too_large",
        }
    }


async def run_stream(text: str, leave_after_chunks: int | None) -> list[dict]:
    """The SSE response on an ASGI 2.3 server (like uvicorn's h11): the client sends
    http.disconnect once it has read `leave_after_chunks` chunks."""
    sent: list[dict] = []
    left = asyncio.Event()

    async def send(message):
        sent.append(message)
        bodies = [m for m in sent if m["type"] == "http.response.body"]
        if leave_after_chunks is not None and len(bodies) >= leave_after_chunks:
            left.set()

    async def receive():
        await left.wait()
        return {"type": "http.disconnect"}

    response = StreamingResponse(sse_stream("chatcmpl-1", "echo", text, "stop"))
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "headers": []}
    if leave_after_chunks is None:
        await response(scope, receive, send)
    else:
        async with asyncio.timeout(30):  # a stream that never yields would run to its end
            await response(scope, receive, send)
    return [m for m in sent if m["type"] == "http.response.body"]


async def test_the_stream_is_the_text_in_few_chunks_then_done():
    text = " ".join(["word"] * 1000)
    bodies = await run_stream(text, None)
    events = [b["body"] for b in bodies if b["body"]]
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == text
    assert len(chunks) == 2 + len(list(deltas(text)))  # 16 chunks, not one per word


async def test_a_client_that_leaves_stops_the_stream():
    text = " ".join(["word"] * 64 * 100)  # 100 chunks of words
    bodies = await run_stream(text, leave_after_chunks=3)
    assert len(bodies) < 10  # cancelled a turn or two after the disconnect
    assert all(b.get("more_body") for b in bodies)  # never finished
