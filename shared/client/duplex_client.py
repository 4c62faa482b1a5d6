"""`DuplexClient`: the Realtime + duplex protocol over a WebSocket, with automatic resume.

It yields typed events, sends typed commands, and survives a lost connection:
it reconnects (jittered backoff, trying each of its URLs in turn, so another
API pod can take over) and sends `session.resume` with its rotated token and
the last `server_event_seq` it received. The server replays what was missed;
the client drops anything it already has, so the stream it yields is
contiguous and free of duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import orjson
import websockets
from websockets.exceptions import ConnectionClosed

from shared.client.receiving import receive_until
from shared.errors import CodedError
from shared.protocol.duplex import (
    AppendAudio,
    CommandContext,
    DuplexCommand,
    DuplexEvent,
    Heartbeat,
    InputAudioBufferAppend,
    InputAudioDefaults,
    SessionEventAck,
    SessionResume,
    UpdateSession,
    parse_client_event,
    parse_server_event,
    server_event_seq,
)

log = logging.getLogger(__name__)


class DuplexClientError(CodedError):
    """The server refused the session (open or resume); `code` is its error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)


@dataclasses.dataclass(frozen=True)
class ReconnectPolicy:
    #: 10 tries, 0.25 s doubling to 4 s, jittered: 14-28 s in all, longer than a Redis
    #: failover's pause (a resume refused meanwhile is tried again) and an API pod's restart
    attempts: int = 10
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 4.0

    def delay(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * (2**attempt))
        return base * random.uniform(0.5, 1.0)  # jitter: reconnecting clients do not stampede


def realtime_url(base: str, *, resume: bool = False) -> str:
    base = base.rstrip("/")
    if base.startswith("http"):
        base = "ws" + base[4:]
    query = "duplex=1&autostart=0" if resume else "duplex=1"
    return f"{base}/v1/realtime?{query}"


class DuplexClient:
    close_timeout_s = 10.0  # close(): the most it waits for session.closed

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        api_key: str | None = None,
        reconnect: ReconnectPolicy = ReconnectPolicy(),
        heartbeat_s: float | None = 30.0,
        ack_every: int = 64,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.api_key = api_key
        self.reconnect_policy = reconnect
        self.heartbeat_s = heartbeat_s
        self.ack_every = ack_every
        self.session_id: str | None = None
        self.session: dict[str, Any] = {}
        self.resume_token: str | None = None
        self.attachment_generation = 0
        self.last_seq = 0
        self.resumes = 0
        #: every server_event_seq as received from the wire, duplicates included (diagnostics)
        self.wire_seqs: list[int] = []
        #: close codes of the connections the server closed (1012: reconnect and resume)
        self.close_codes: list[int] = []
        self._url_index = 0
        self._ws: Any = None
        self._connected = asyncio.Event()
        self._events: asyncio.Queue[DuplexEvent | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._relinked = asyncio.Event()  # set (and replaced) whenever `_ws` is replaced
        self._failure: DuplexClientError | None = None  # the resume that ended the session
        self._acks: set[asyncio.Task[None]] = set()  # event acks being sent
        self._unacked = 0
        self._defaults = InputAudioDefaults()

    # ------------------------------------------------------------ connect

    async def _dial(self, resume: bool) -> Any:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        url = realtime_url(self.urls[self._url_index % len(self.urls)], resume=resume)
        return await websockets.connect(
            url, additional_headers=headers, max_size=None, open_timeout=10
        )

    async def connect(self, session: Mapping[str, Any] | None = None) -> DuplexClient:
        """Open a new session; returns once `session.created` arrived."""
        self._ws = await self._dial(resume=False)
        await self._ws.send(UpdateSession(patch=dict(session or {})).to_json().decode())
        created = await self._read_one()
        if created.get("type") != "session.created":
            await self._ws.close()
            error = created.get("error", {})
            raise DuplexClientError(
                error.get("code", "unknown"), error.get("message", str(created))
            )
        self._adopt_session(created)
        self.session_id = created["session"]["id"]
        self.resume_token = created.get("resume_token")
        self.attachment_generation = created.get("attachment_generation") or 0
        self._events.put_nowait(parse_server_event(created))
        self._connected.set()
        self._tasks.append(asyncio.create_task(self._read_loop(), name="duplex-client-reader"))
        if self.heartbeat_s:
            self._tasks.append(
                asyncio.create_task(self._heartbeat_loop(), name="duplex-client-heartbeat")
            )
        return self

    async def _read_one(self) -> dict[str, Any]:
        async with asyncio.timeout(15):
            return orjson.loads(await self._ws.recv())

    def _adopt_session(self, event: Mapping[str, Any]) -> None:
        session = event.get("session")
        if isinstance(session, dict):
            self.session = session
            with contextlib.suppress(Exception):
                self._defaults = InputAudioDefaults().updated(session)

    async def _resume(self) -> None:
        """Reconnect (next URL first) and resume; raise DuplexClientError when refused."""
        policy = self.reconnect_policy
        last_error: BaseException | None = None
        for attempt in range(policy.attempts):
            self._url_index += 1
            try:
                ws = await self._dial(resume=True)
            except (OSError, ConnectionClosed, TimeoutError, websockets.InvalidHandshake) as exc:
                last_error = exc
                await asyncio.sleep(policy.delay(attempt))
                continue
            request = SessionResume(
                session_id=self.session_id or "",
                resume_token=self.resume_token or "",
                last_received_server_event_seq=self.last_seq,
            )
            await ws.send(request.to_json().decode())
            async with asyncio.timeout(15):
                reply = orjson.loads(await ws.recv())
            if reply.get("type") == "session.resumed":
                self._ws = ws
                self._relink()
                self.resume_token = reply.get("resume_token") or self.resume_token
                self.attachment_generation = reply.get(
                    "attachment_generation", self.attachment_generation
                )
                self._adopt_session(reply)
                self.resumes += 1
                self._events.put_nowait(parse_server_event(reply))
                return
            await ws.close()
            if reply.get("type") == "session.resync_required":
                raise DuplexClientError(
                    "session.resync_required", reply.get("reason", "journal_gap")
                )
            error = reply.get("error", {})
            refused = DuplexClientError(error.get("code", "unknown"), error.get("message", ""))
            if not error.get("retryable"):
                raise refused
            # the server could not take the session over now (its store failing over):
            # nothing was done, the next attempt may
            last_error = refused
            await asyncio.sleep(policy.delay(attempt))
        raise DuplexClientError("reconnect_failed", f"could not reconnect: {last_error}")

    # ------------------------------------------------------------ events

    async def _read_loop(self) -> None:
        while True:
            try:
                async for raw in self._ws:
                    self._deliver(orjson.loads(raw))
                if self._closing:
                    return
            except ConnectionClosed as exc:
                if self._closing:
                    return
                if exc.rcvd is not None:
                    self.close_codes.append(exc.rcvd.code)
            self._connected.clear()
            try:
                await self._resume()
            except DuplexClientError as exc:
                self._failure = exc
                self._relink()  # senders waiting for a new connection hear the failure
                self._events.put_nowait(exc)
                return
            self._connected.set()

    def _relink(self) -> None:
        """The socket was replaced (or will never be): wake the senders waiting for it."""
        relinked, self._relinked = self._relinked, asyncio.Event()
        relinked.set()

    def _deliver(self, data: dict[str, Any]) -> None:
        seq = server_event_seq(data)
        if seq is not None:
            self.wire_seqs.append(seq)
            if seq <= self.last_seq:
                return  # replayed twice: already delivered
            self.last_seq = seq
            self._unacked += 1
        if data.get("type") == "session.updated":
            self._adopt_session(data)
        self._events.put_nowait(parse_server_event(data))
        if self._unacked >= self.ack_every:
            self._unacked = 0
            ack = asyncio.get_running_loop().create_task(
                self._send_raw(SessionEventAck(server_event_seq=self.last_seq)),
                name="duplex-client-ack",
            )
            self._acks.add(ack)  # held, so it is not collected mid-send
            ack.add_done_callback(self._ack_sent)

    def _ack_sent(self, ack: asyncio.Task[None]) -> None:
        """An ack that could not be sent is dropped: a later one covers it, and a session
        that ended reaches the application through `recv`, not through its acks."""
        self._acks.discard(ack)
        if not ack.cancelled() and (exc := ack.exception()) is not None:
            log.debug("event ack not sent: %s", exc)

    async def recv(self, timeout: float | None = 30.0) -> DuplexEvent:
        async with asyncio.timeout(timeout):
            item = await self._events.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def events(self) -> AsyncIterator[DuplexEvent]:
        while True:
            yield await self.recv(timeout=None)

    async def until(self, wire_type: str, timeout: float = 30.0) -> list[DuplexEvent]:
        """Every event up to and including the first of `wire_type`."""
        return await receive_until(self.recv, wire_type, timeout)

    # ------------------------------------------------------------ commands

    async def _send_raw(self, command: DuplexCommand) -> None:
        data = command.to_json().decode()
        while True:
            await self._connected.wait()
            ws, relinked = self._ws, self._relinked
            try:
                await ws.send(data)
                return
            except ConnectionClosed:
                if self._closing:
                    raise
                # The reader resumes on a new connection. It may not have seen this close
                # yet (`_connected` still set: a write can fail before the read does), so
                # wait for the socket to be replaced, not for `_connected`.
                await relinked.wait()
                if self._failure is not None:
                    raise self._failure from None

    async def send(self, command: DuplexCommand | Mapping[str, Any]) -> None:
        """Send a command. A dict is parsed with the input formats the server last
        confirmed (session.created/.updated), never with a session.update not yet answered:
        the server may refuse it."""
        if not isinstance(command, DuplexCommand):
            command = parse_client_event(command, CommandContext(self._defaults))
        await self._send_raw(command)

    async def append_audio(
        self, pcm: bytes, *, format: str | None = None, sample_rate_hz: int | None = None
    ) -> None:
        """Append audio. Without `format` and `sample_rate_hz` the append declares none: the
        server reads it in the session's input format as the worker has it (a session.update
        the worker refused does not change it); with either, the append says its own."""
        if format is None and sample_rate_hz is None:
            await self.send(InputAudioBufferAppend(audio=pcm))
            return
        fmt = self._defaults.input_format
        await self.send(
            AppendAudio(
                audio=pcm,
                format=format or fmt.encoding,
                sample_rate_hz=sample_rate_hz or fmt.rate or 16000,
            )
        )

    async def commit(self, create_response: bool = True) -> None:
        await self.send({"type": "input_audio_buffer.commit", "create_response": create_response})

    async def cancel(self) -> None:
        await self.send({"type": "response.cancel"})

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s or 30.0)
            with contextlib.suppress(Exception):
                await self._send_raw(Heartbeat())

    async def close(self, *, end_session: bool = True) -> None:
        """Close the session (and wait for `session.closed`), or just drop the socket."""
        if end_session and self._ws is not None:
            # bounded: while a resume is failing, a send would wait for a connection that
            # never comes (found by bench/chaos under CPU load)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.close_timeout_s):
                    await self.send({"type": "session.close"})
                    await self.until("session.closed", timeout=self.close_timeout_s)
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self._ws is not None:
            with contextlib.suppress(Exception):
                await self._ws.close()

    async def drop_connection(self) -> None:
        """Close the socket without closing the session (tests and consoles use it to resume)."""
        await self._ws.close()
