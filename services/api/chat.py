"""`POST /v1/chat/completions`: OpenAI's chat API over a worker's `chat_completion`.

Every cost is bounded, because the request comes from anyone with a key (or
anyone, without keys) and runs on the pod's one event loop (issue 14):

- the body: at most `chat_max_body_bytes`, refused with 413 from Content-Length
  when it declares more, else counted while it streams in (a 10 MiB body is
  never buffered); it must arrive within `chat_timeout_s`;
- the reply: at most `MAX_REPLY_CHARS` characters are returned or streamed,
  `finish_reason: "length"` says when the worker's text was cut;
- the stream: one SSE chunk per batch of up to `CHUNK_WORDS` words or
  `CHUNK_CHARS` characters, and a turn of the loop after each, so other
  sockets are served between chunks and a client that leaves stops it
  (Starlette cancels the stream on `http.disconnect`; a cancellation can only
  land at an await, which the old one-chunk-per-word loop never reached).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from services.api.inbox_writer import InboxFull
from services.api.worker_client import WorkerClient
from shared.redis.boundary import ChatReply
from shared.redis.keys import KeySchema
from shared.redis.placement import WorkerDirectory

#: a reply is cut here (64 Ki characters, about 16k tokens): a chat through a speech
#: model's API is short, and the cap bounds what one request can make the pod send
MAX_REPLY_CHARS = 64 * 1024
#: an SSE chunk carries up to this many words...
CHUNK_WORDS = 64
#: ...or this many characters, whichever comes first
CHUNK_CHARS = 1024


def openai_error(
    status: int, message: str, code: str, error_type: str = "invalid_request_error"
) -> JSONResponse:
    """An error in the shape OpenAI's REST API (and its SDKs) use."""
    return JSONResponse(
        {"error": {"message": message, "type": error_type, "code": code}}, status_code=status
    )


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or BodyTooLarge as soon as it is known to exceed `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge  # refused before one byte of it is read
    body = bytearray()
    async for chunk in request.stream():  # chunked bodies: counted as they come
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge
    return bytes(body)


def deltas(text: str) -> Iterator[str]:
    """`text` in pieces of up to CHUNK_WORDS words or CHUNK_CHARS characters; joined,
    they are `text` again (spaces kept, a very long word sliced)."""
    batch: list[str] = []
    size = 0
    for index, word in enumerate(text.split(" ")):
        token = word if index == 0 else " " + word
        while len(token) > CHUNK_CHARS:
            if batch:
                yield "".join(batch)
                batch, size = [], 0
            yield token[:CHUNK_CHARS]
            token = token[CHUNK_CHARS:]
        if batch and (len(batch) >= CHUNK_WORDS or size + len(token) > CHUNK_CHARS):
            yield "".join(batch)
            batch, size = [], 0
        batch.append(token)
        size += len(token)
    if batch:
        yield "".join(batch)


async def sse_stream(
    completion_id: str, model: str, text: str, finish: str
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        body = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    for piece in deltas(text):
        yield chunk({"content": piece})
        # a turn of the loop per chunk: other sockets run, a disconnect cancels us here
        await asyncio.sleep(0)
    yield chunk({}, finish)
    yield b"data: [DONE]\n\n"


class ChatCompletions:
    """The route's logic, API side: hands the messages to a worker, answers its reply."""

    def __init__(
        self,
        client: Any,
        keys: KeySchema,
        directory: WorkerDirectory,
        max_body_bytes: int,
        timeout_s: float,
        workers: WorkerClient,
    ) -> None:
        self.client = client
        self.keys = keys
        self.workers = workers
        self.directory = directory
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s

    async def __call__(self, request: Request) -> Response:
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await read_body(request, self.max_body_bytes)
        except BodyTooLarge:
            return openai_error(
                413,
                f"the request body is larger than {self.max_body_bytes} bytes",
                "request_too_large",
            )
        except TimeoutError:
            return openai_error(408, "the request body did not arrive in time", "timeout")
        except ClientDisconnect:
            return Response(status_code=400)  # nobody is left to read it
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return openai_error(400, "the body is not JSON", "invalid_json")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return openai_error(400, "messages must be a list", "bad_event")
        model = body.get("model")
        workers = [
            w
            for w in await self.directory.candidates(model)
            if w.capabilities.get("supports_chat_completions")
        ]
        if not workers:
            return openai_error(
                404, f"no live worker serves chat completions for {model!r}", "model_not_found"
            )
        request_id = uuid.uuid4().hex
        try:  # within the inbox's byte budget, like the sessions' commands; deleted once handled
            await self.workers.chat(workers[0].worker_id, request_id, body["messages"])
        except InboxFull:
            return openai_error(
                429, "the worker has too many unhandled requests; retry", "rate_limit_exceeded"
            )
        reply = await self.client.blpop([self.keys.reply(request_id)], timeout=int(self.timeout_s))
        if reply is None:
            return openai_error(504, "the worker did not answer in time", "timeout", "server_error")
        answer = ChatReply.parse(reply[1])
        if not answer.ok:
            status = 429 if answer.code == "resource_exhausted" else 400
            return openai_error(status, answer.message, answer.code)
        text = answer.text
        finish = "stop"
        if len(text) > MAX_REPLY_CHARS:
            text, finish = text[:MAX_REPLY_CHARS], "length"
        completion_id = f"chatcmpl-{request_id}"
        served = model or workers[0].model
        if body.get("stream"):
            return StreamingResponse(
                sse_stream(completion_id, served, text, finish), media_type="text/event-stream"
            )
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": served,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )
