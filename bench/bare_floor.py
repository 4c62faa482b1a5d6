"""The bare WebSocket floor: what an API pod or a worker is compared with.

    .venv/bin/python -m bench.bare_floor --port P [--frames deltas|wire]

The same server stack as `duplex api` (uvicorn, h11, the websockets-sansio implementation
without permessage-deflate, uvloop, a Starlette WebSocket endpoint reading with `receive()`
and writing with `send_text()`), and nothing else: no Redis, no worker, no JSON parsing.
It reads every frame of `/v1/realtime?duplex=1` and tells frames apart by a substring test:
  session.update     the first one is answered with a `session.created` and a small
                     `session.updated` (the real path's open)
  input.commit       starts an answer shaped as the echo model's for bench.capacity: 20
                     `response.output_audio.delta` events of 100 ms (the real delta's JSON
                     shape and size: 24 kHz pcm16, about 7 KB) paced 100 ms apart, then a
                     `response.done` as the real one
  session.heartbeat  answered at once with a `session.heartbeat_ack`
  session.close      answered with `session.closed`, then the socket is closed
Everything else (the 20 ms appends) is read and dropped. With `--frames wire` it also sends
the ~300-byte events the real path sends around an answer (39 of them: 12 before the first
delta, a transcript delta after each audio delta, 5 before `response.done`, 2 after
`input_audio_buffer.clear`), so that the frame count matches too (60 a turn, not 21).
bench.capacity runs the same conversations against it for the CPU floor; bench.latency
times its heartbeat round trip for the WebSocket part of the composed floor. It imports
nothing of the product, so the floor is the same whichever commit of the product is
measured.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from array import array
from pathlib import Path

from harness.processes import HttpProcess
from harness.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]
FRAMES = ("deltas", "wire")
DELTAS = 20  # the echo answer to a 2 s turn: 20 chunks of 100 ms
DELTA_S = 0.1
OUTPUT_RATE_HZ = 24000  # the echo model resamples to its 24 kHz output
# --frames wire: the small events of a real echo turn, in the order they are sent
WIRE_BEFORE_FIRST = (
    "input_audio_buffer.speech_started",
    "input_audio_buffer.speech_stopped",
    "conversation.item.added",
    "conversation.item.created",
    "input_audio_buffer.committed",
    "conversation.item.done",
    "response.created",
    "conversation.item.added",
    "conversation.item.created",
    "response.output_item.added",
    "response.content_part.added",
    "response.speak",
)
WIRE_AFTER_DELTA = ("response.output_audio_transcript.delta",)
WIRE_BEFORE_DONE = (
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
)
WIRE_ON_CLEAR = ("input_audio_buffer.cleared", "rate_limits.updated")


def _chunk_b64() -> str:
    """100 ms of a 330 Hz tone, 24 kHz pcm16, base64: the real delta's 6400 characters."""
    count = OUTPUT_RATE_HZ // 10
    samples = array(
        "h", (int(8000 * math.sin(2 * math.pi * 330 * i / OUTPUT_RATE_HZ)) for i in range(count))
    )
    return base64.b64encode(samples.tobytes()).decode()


CHUNK_B64 = _chunk_b64()


def _hex() -> str:
    return uuid.uuid4().hex


def delta_event(session_id: str, response_id: str, index: int, seq: int) -> str:
    """The echo worker's `response.output_audio.delta`, field for field (6994-6999 bytes)."""
    played = float(100 * (index + 1))
    return (
        '{"type":"response.output_audio.delta","event_id":"event_' + _hex() + '",'
        f'"response_id":"resp_{response_id}","item_id":"item_resp_{response_id}",'
        '"output_index":0,"content_index":0,"delta":"' + CHUNK_B64 + '",'
        f'"format":"pcm16","sample_rate_hz":{OUTPUT_RATE_HZ},"metadata":{{"session_id":'
        f'"duplex-{session_id}","epoch":0,"model_speak":true,"end_of_turn":false,'
        f'"audio_duration_ms":{played},"audio_text_marks":[{{"text_chars":1,'
        f'"audio_end_ms":{played}}}],"playback":{{"generated_ms":{played},'
        f'"sent_ms":{played},"played_ms":0.0,"committed_ms":0.0}}}},"server_event_seq":{seq}}}'
    )


def small_event(wire_type: str, response_id: str, seq: int) -> str:
    """One of the real path's small events around an answer (about 300 bytes, as theirs)."""
    return (
        f'{{"type":"{wire_type}","event_id":"event_{_hex()}","response_id":"resp_'
        f'{response_id}","item_id":"item_resp_{response_id}","output_index":0,'
        f'"content_index":0,"previous_item_id":null,"delta":"e","server_event_seq":{seq}}}'
    )


def done_event(response_id: str, turn: int, seq: int) -> str:
    """The echo worker's `response.done` for a 2 s answer (717 bytes)."""
    item = (
        f'{{"id":"item_resp_{response_id}","object":"realtime.item","type":"message",'
        '"role":"assistant","status":"completed","content":[{"type":"output_audio",'
        '"transcript":"echo 2000 ms"}]}'
    )
    return (
        '{"type":"response.done","event_id":"event_' + _hex() + '","response":{'
        f'"id":"resp_{response_id}","object":"realtime.response","status":"completed",'
        f'"status_details":null,"output":[{item}],"modalities":["text","audio"],'
        '"output_modalities":["text","audio"],"metadata":{"duplex_event":{"epoch":0,'
        f'"turn_id":{turn}}},"committed":true,"playback":{{"generated_ms":2000.0,'
        '"sent_ms":2000.0,"played_ms":0.0,"committed_ms":2000.0}}},'
        f'"response_id":"resp_{response_id}","server_event_seq":{seq}}}'
    )


class FloorSession:
    """One socket: the reader answers at once; an answer is its own task, paced as the echo
    model paces (delta i leaves i x 100 ms after the first; done right after the last)."""

    def __init__(self, websocket, wire: bool) -> None:
        self.ws = websocket
        self.wire = wire
        self.session_id = _hex()
        self.seq = 0
        self.turn = 0
        self.created = False
        self.answer: asyncio.Task[None] | None = None

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    async def run(self) -> None:
        await self.ws.accept()
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    continue
                # base64 has no '.' or '"': these substrings never match inside audio
                if '"input.commit"' in text:
                    self.turn += 1
                    self.answer = asyncio.create_task(self._answer(self.turn))
                elif self.wire and '"input_audio_buffer.clear"' in text:
                    await self._smalls(WIRE_ON_CLEAR, "")
                elif '"session.heartbeat"' in text:
                    await self.ws.send_text(self._ack())
                elif '"session.update"' in text and not self.created:
                    self.created = True
                    await self.ws.send_text(self._created())
                    # as the real path: session.updated follows it (vLLM-Omni 0.30.0)
                    await self.ws.send_text(small_event("session.updated", "", self.next_seq()))
                elif '"session.close"' in text:
                    await self.ws.send_text(self._closed())
                    await self.ws.close(1000)
                    return
        finally:
            if self.answer is not None:
                self.answer.cancel()
                with contextlib.suppress(BaseException):
                    await self.answer

    async def _answer(self, turn: int) -> None:
        response_id = _hex()
        await self._smalls(WIRE_BEFORE_FIRST, response_id)
        started = time.monotonic()
        for index in range(DELTAS):
            await asyncio.sleep(max(0.0, started + index * DELTA_S - time.monotonic()))
            await self.ws.send_text(
                delta_event(self.session_id, response_id, index, self.next_seq())
            )
            await self._smalls(WIRE_AFTER_DELTA, response_id)
        await self._smalls(WIRE_BEFORE_DONE, response_id)
        await self.ws.send_text(done_event(response_id, turn, self.next_seq()))

    async def _smalls(self, wire_types: tuple[str, ...], response_id: str) -> None:
        if self.wire:
            for wire_type in wire_types:
                await self.ws.send_text(small_event(wire_type, response_id, self.next_seq()))

    def _ack(self) -> str:
        return (
            '{"type":"session.heartbeat_ack","event_id":"event_' + _hex() + '",'
            f'"session_id":"duplex-{self.session_id}","server_event_seq":{self.next_seq()}}}'
        )

    def _created(self) -> str:
        return (
            '{"type":"session.created","event_id":"event_' + _hex() + '","session":{'
            f'"id":"duplex-{self.session_id}","object":"realtime.session","model":"floor"}}}}'
        )

    def _closed(self) -> str:
        return (
            '{"type":"session.closed","event_id":"event_' + _hex() + '",'
            f'"session_id":"duplex-{self.session_id}","reason":"client_close",'
            f'"server_event_seq":{self.next_seq()}}}'
        )


def create_app(wire: bool = False):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route, WebSocketRoute

    async def realtime(websocket) -> None:
        await FloorSession(websocket, wire).run()

    async def ready(request) -> PlainTextResponse:
        return PlainTextResponse("ready")

    return Starlette(
        routes=[Route("/health/ready", ready), WebSocketRoute("/v1/realtime", realtime)]
    )


def serve(port: int, wire: bool) -> None:
    import uvicorn

    config = uvicorn.Config(
        create_app(wire),
        host="127.0.0.1",
        port=port,
        http="h11",  # as the API pod (its guarded h11 differs only before the upgrade)
        ws="websockets-sansio",
        ws_per_message_deflate=False,
        log_level="warning",
        lifespan="off",
    )
    factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(uvicorn.Server(config).serve())


class BareFloorProcess(HttpProcess):
    """`python -m bench.bare_floor` as a real process, awaited and stopped as the `duplex`
    processes are (harness.processes.Process only starts `duplex`, so the start is here)."""

    def __init__(self, name: str = "bare-floor", frames: str = "deltas") -> None:
        self.name = name
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix=f"duplex-{name}-", suffix=".log")[1])
        environment = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.bare_floor",
                "--port",
                str(self.port),
                "--frames",
                frames,
            ],
            cwd=ROOT,  # `-m` finds this checkout's bench/ first, whichever commit it is
            env=environment,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )

    @property
    def ws_base(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def __enter__(self) -> BareFloorProcess:
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--frames",
        choices=FRAMES,
        default="deltas",
        help="deltas: the audio deltas and response.done only; wire: every event of a turn",
    )
    args = parser.parse_args()
    serve(args.port, args.frames == "wire")
