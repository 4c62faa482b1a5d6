"""One client per protocol the API pod speaks, behind one interface, for the socket-level
suite that runs over every protocol (`tests/e2e/test_protocol_suite.py`).

Each client does on the wire what that protocol's own clients do: the openai surface as
the official SDK (GA events), the duplex surface as `DuplexClient` (our extensions:
`barge_in`, `session.resume`), GPT-Live as LiveKit's `GPTLiveModel` (`session.start`,
100 ms base64 appends), Moshi's protocol as LiveKit's PersonaPlex plugin (the `0x00`
handshake, Ogg Opus pages) and MAP Realtime V1 as OpenBMB's `openbmb-realtime` SDK
(`session.queue_done` before `session.init`, float32 audio, `force_listen`). A protocol
added to the pod gets the suite by adding its client here and naming it in
`PROTOCOL_CLIENTS`.

Every client reads its socket in a task of its own and counts what it heard: the loud
audio frames (`loud`, the model's speech; silence is not counted), the errors by code,
whether the socket was closed and with which code. Audio is 24 kHz mono float32 in and
out (the test model's rate); sending is paced as a microphone is (pacing, not an ordering
of events: the suite waits on what the client heard).
"""

from __future__ import annotations

import abc
import asyncio
import base64
import contextlib
from typing import Any, ClassVar

import numpy as np
import orjson
import sphn
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

RATE = 24_000
#: a decoded chunk of the model's audio louder than this is its speech
LOUD = 0.1
WAIT_S = 30.0


def ws_base(http_base: str) -> str:
    return "ws" + http_base[4:]


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def from_pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32767


class ProtocolClient(abc.ABC):
    #: the protocol's name, as the suite's parameters show it
    protocol: ClassVar[str]
    #: a dropped socket may be resumed (else the session ends with its socket)
    resumes: ClassVar[bool] = False
    #: the client can interrupt the model's speech with a message of the protocol
    barge_in_message: ClassVar[bool] = False
    #: what a client sends per message, in seconds of audio
    chunk_s: ClassVar[float] = 0.08
    #: how the protocol says no to `send_malformed` (`refusal`): an error code, or
    #: `close:<code>` for a protocol whose answer is the socket's close
    malformed_refusal: ClassVar[str]

    def __init__(self, http_base: str, model: str, key: str | None = None) -> None:
        self.base = ws_base(http_base)
        self.model = model
        self.key = key
        self.ws: ClientConnection | None = None
        self.session_id: str | None = None
        self.loud = 0
        self.errors: list[str] = []
        self.events: list[str] = []  # the kinds of what was received, in order
        self.close_code: int | None = None
        self._reader: asyncio.Task[None] | None = None
        self._heard = asyncio.Event()

    # ------------------------------------------------------------ the protocol's part

    @abc.abstractmethod
    async def _open(self) -> str:
        """Connect, open the session, and wait until it may be spoken to; its id."""

    @abc.abstractmethod
    def _take(self, message: str | bytes) -> None:
        """One received message: count its audio, errors and kind."""

    @abc.abstractmethod
    async def _send_audio(self, audio: np.ndarray) -> None:
        """One chunk of the microphone."""

    @abc.abstractmethod
    async def send_malformed(self) -> None:
        """A message the protocol refuses (its refusal: `refusal`)."""

    @abc.abstractmethod
    def refusal(self) -> str | None:
        """How the protocol said no to `send_malformed`: an error code, or `close:<code>`
        for a protocol that closes the socket; None: not said yet."""

    async def barge_in(self) -> None:
        raise NotImplementedError(f"{self.protocol} has no barge-in message")

    def cancelled(self) -> bool:
        """The model's speech was cut by `barge_in` (the protocol said so)."""
        raise NotImplementedError(f"{self.protocol} has no barge-in message")

    async def resume(self) -> bool:
        raise NotImplementedError(f"{self.protocol} has no resume")

    # ------------------------------------------------------------ shared

    async def open(self) -> str:
        self.session_id = await self._open()
        assert self.ws is not None
        self._reader = asyncio.create_task(self._read(self.ws))
        return self.session_id

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for message in ws:
                self._take(message)
        except ConnectionClosed:
            pass
        if ws.close_code is not None and ws is self.ws:
            self.close_code = ws.close_code

    def heard_loud(self, samples: np.ndarray) -> None:
        if samples.size and float(np.abs(samples).max()) > LOUD:
            self.loud += 1

    async def speak(self, audio: np.ndarray) -> None:
        step = int(self.chunk_s * RATE)
        for start in range(0, len(audio) - step + 1, step):
            await self._send_audio(audio[start : start + step])
            await asyncio.sleep(self.chunk_s)

    async def drop(self) -> None:
        """The network goes: the socket ends without a close handshake."""
        assert self.ws is not None
        self.ws.transport.abort()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(WAIT_S):  # its reader sees the socket end
                    await self._reader

    async def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader

    async def __aenter__(self) -> ProtocolClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _RealtimeJson(ProtocolClient):
    """The Realtime protocol's JSON events (the openai and duplex surfaces)."""

    query: ClassVar[str]
    chunk_s = 0.04
    malformed_refusal = "unknown_event"

    def __init__(self, http_base: str, model: str, key: str | None = None) -> None:
        super().__init__(http_base, model, key)
        #: each response.done's status, in order
        self.statuses: list[str] = []

    async def _open(self) -> str:
        url = f"{self.base}/v1/realtime?{self.query}model={self.model}"
        self.ws = await connect(url, additional_headers=self.headers())
        created = await self._first("session.created")
        self.created = created
        return str(created["session"]["id"])

    async def _first(self, wire_type: str) -> dict[str, Any]:
        assert self.ws is not None
        async with asyncio.timeout(WAIT_S):
            while True:
                event = orjson.loads(await self.ws.recv())
                self._take_event(event)
                if event["type"] == wire_type:
                    return event

    def _take(self, message: str | bytes) -> None:
        self._take_event(orjson.loads(message))

    def _take_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        self.events.append(str(kind))
        if kind == "response.output_audio.delta":
            self.heard_loud(from_pcm16(base64.b64decode(event["delta"])))
        elif kind == "response.done":
            self.statuses.append(str(event["response"].get("status")))
        elif kind == "error":
            self.errors.append(str(event["error"].get("code")))
        if "server_event_seq" in event:
            self.last_seq = int(event["server_event_seq"])

    async def send(self, event: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(orjson.dumps(event).decode())

    async def _send_audio(self, audio: np.ndarray) -> None:
        chunk = base64.b64encode(pcm16(audio)).decode()
        await self.send({"type": "input_audio_buffer.append", "audio": chunk})

    async def send_malformed(self) -> None:
        await self.send({"type": "dance", "event_id": "bad-1"})

    def refusal(self) -> str | None:
        return self.errors[-1] if self.errors else None

    def cancelled(self) -> bool:
        return "cancelled" in self.statuses


class OpenAIClient(_RealtimeJson):
    """OpenAI's Realtime GA API (plain `/v1/realtime`), as the official SDK speaks it."""

    protocol = "openai"
    query = ""
    barge_in_message = True

    async def barge_in(self) -> None:
        await self.send({"type": "response.cancel"})


class DuplexSurfaceClient(_RealtimeJson):
    """The duplex surface (`/v1/realtime?duplex=1`), as `DuplexClient` speaks it."""

    protocol = "duplex"
    query = "duplex=1&"
    resumes = True
    barge_in_message = True
    last_seq = 0

    async def barge_in(self) -> None:
        await self.send({"type": "barge_in"})

    async def resume(self) -> bool:
        """A new socket resumes the session from the last event this one received."""
        url = f"{self.base}/v1/realtime?duplex=1&resume=1"
        self.ws = await connect(url, additional_headers=self.headers())
        await self.send(
            {
                "type": "session.resume",
                "session_id": self.session_id,
                "resume_token": self.created["resume_token"],
                "last_received_server_event_seq": self.last_seq,
            }
        )
        await self._first("session.resumed")
        self._reader = asyncio.create_task(self._read(self.ws))
        return True


class LiveClient(ProtocolClient):
    """OpenAI's GPT-Live protocol (`/v1/live/sessions`), as LiveKit's GPTLiveModel speaks
    it: 100 ms appends."""

    protocol = "live"
    chunk_s = 0.1
    malformed_refusal = "unknown_event"

    async def _open(self) -> str:
        self.ws = await connect(f"{self.base}/v1/live/sessions", additional_headers=self.headers())
        await self.ws.send(
            orjson.dumps({"type": "session.start", "session": {"model": self.model}}).decode()
        )
        async with asyncio.timeout(WAIT_S):
            while True:
                message = await self.ws.recv()
                self._take(message)
                if self.events[-1] == "session.started":
                    event = orjson.loads(message)
                    return str(event["session"]["id"])

    def _take(self, message: str | bytes) -> None:
        event = orjson.loads(message)
        kind = event.get("type")
        self.events.append(str(kind))
        if kind == "session.output_audio.delta":
            self.heard_loud(from_pcm16(base64.b64decode(event["delta"])))
        elif kind == "error":
            self.errors.append(str(event["error"].get("code")))

    async def _send_audio(self, audio: np.ndarray) -> None:
        assert self.ws is not None
        chunk = base64.b64encode(pcm16(audio)).decode()
        await self.ws.send(
            orjson.dumps({"type": "session.input_audio.append", "audio": chunk}).decode()
        )

    async def send_malformed(self) -> None:
        assert self.ws is not None
        await self.ws.send(orjson.dumps({"type": "dance", "event_id": "bad-1"}).decode())

    def refusal(self) -> str | None:
        return self.errors[-1] if self.errors else None


class MoshiClient(ProtocolClient):
    """Moshi's binary protocol (`/api/chat`), as LiveKit's PersonaPlex plugin speaks it:
    the key in the path, Ogg Opus pages of 80 ms."""

    protocol = "moshi"
    chunk_s = 0.08
    malformed_refusal = "close:1003"

    async def _open(self) -> str:
        path = f"/key/{self.key}/api/chat" if self.key else "/api/chat"
        self.ws = await connect(f"{self.base}{path}?model={self.model}")
        self.writer = sphn.OpusStreamWriter(RATE)
        self.reader = sphn.OpusStreamReader(RATE)
        async with asyncio.timeout(WAIT_S):
            handshake = await self.ws.recv()
        assert handshake == b"\x00", handshake
        self.events.append("handshake")
        return ""  # the protocol never names its session

    def _take(self, message: str | bytes) -> None:
        assert isinstance(message, bytes)
        if message[:1] == b"\x01":
            self.events.append("audio")
            self.heard_loud(self.reader.append_bytes(message[1:]))
        elif message[:1] == b"\x02":
            self.events.append("text")

    async def _send_audio(self, audio: np.ndarray) -> None:
        assert self.ws is not None
        await self.ws.send(b"\x01" + self.writer.append_pcm(audio))

    async def send_malformed(self) -> None:
        assert self.ws is not None
        await self.ws.send("a text frame")  # the protocol's messages are binary

    def refusal(self) -> str | None:
        return f"close:{self.close_code}" if self.close_code is not None else None


class MapClient(ProtocolClient):
    """OpenBMB's MAP Realtime V1 (`/v1/realtime` with the subprotocol `map.realtime`), as
    the `openbmb-realtime` SDK speaks it: `session.init` once the server said
    `session.queue_done`, base64 float32 16 kHz appends (100 ms here), the SDK's
    `interrupt()` as `force_listen` on the next append, float32 24 kHz audio back. A refusal
    the session outlives is a `warning` (an `error` would end the SDK's session): both are
    counted in `errors`."""

    protocol = "map"
    chunk_s = 0.1
    barge_in_message = True
    malformed_refusal = "unknown_event"
    input_rate = 16_000

    def __init__(self, http_base: str, model: str, key: str | None = None) -> None:
        super().__init__(http_base, model, key)
        self.statuses: list[str] = []  # each response.done's status, in order
        self.force_listen = False  # set by barge_in: the next append carries it

    async def _open(self) -> str:
        url = f"{self.base}/v1/realtime?mode=audio&model={self.model}"
        self.ws = await connect(
            url,
            additional_headers=self.headers(),
            subprotocols=["map.realtime"],  # type: ignore[list-item]
        )
        async with asyncio.timeout(WAIT_S):
            while True:
                event = orjson.loads(await self.ws.recv())
                self._take_event(event)
                if event["type"] == "session.queue_done":
                    await self.send({"type": "session.init", "payload": {}})
                elif event["type"] == "session.created":
                    return str(event["session_id"])

    def _take(self, message: str | bytes) -> None:
        self._take_event(orjson.loads(message))

    def _take_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        self.events.append(str(kind))
        if kind == "response.output_audio.delta":
            self.heard_loud(np.frombuffer(base64.b64decode(event["audio"]), "<f4"))
        elif kind == "response.done":
            self.statuses.append(str(event["response"].get("status")))
        elif kind in ("error", "warning"):
            self.errors.append(str(event[kind].get("code")))

    async def send(self, event: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(orjson.dumps(event).decode())

    async def _send_audio(self, audio: np.ndarray) -> None:
        at_16k = np.interp(
            np.arange(len(audio) * self.input_rate // RATE) * RATE / self.input_rate,
            np.arange(len(audio)),
            audio,
        ).astype("<f4")
        payload: dict[str, Any] = {"audio": base64.b64encode(at_16k.tobytes()).decode()}
        if self.force_listen:
            payload["force_listen"], self.force_listen = True, False
        await self.send({"type": "input.append", "input": payload})

    async def send_malformed(self) -> None:
        await self.send({"type": "dance"})

    def refusal(self) -> str | None:
        return self.errors[-1] if self.errors else None

    async def barge_in(self) -> None:
        self.force_listen = True

    def cancelled(self) -> bool:
        return "cancelled" in self.statuses


#: every protocol the pod speaks, by name: the suite runs over each
PROTOCOL_CLIENTS: dict[str, type[ProtocolClient]] = {
    client.protocol: client
    for client in (OpenAIClient, DuplexSurfaceClient, LiveClient, MoshiClient, MapClient)
}
