"""The worker process: registry + heartbeat, the inbox consumer, the session manager.

The inbox consumer (`inbox_reader`) reads the worker's inbox stream, unpacks each entry and
dispatches its messages in order; entries are acknowledged in batches after dispatch.
Commands carry (attachment generation, seq): a redelivered one is dropped, and a session
moved here gets its commands in order (`command_order`). Entries and the registration hash
are records of `shared.redis.boundary`; the long-lived loops run supervised (`shared.supervised`).
SIGTERM drains (`drain`); restores and the zombie check are in `ownership`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from redis import exceptions as redis_errors

from services.worker import ownership
from services.worker.command_order import CommandOrder, Released
from services.worker.drain import Drain
from services.worker.health import HealthServer
from services.worker.host import WorkerHost
from services.worker.inbox_reader import InboxReader
from services.worker.metrics import WorkerMetrics
from services.worker.plugins import build_frame_stage, load_plugin
from services.worker.publisher import RedisEventPublisher
from services.worker.session.manager import SessionManager
from shared.contracts import DuplexSessionError, FrameClockedPlugin, SessionRuntimeConfig
from shared.protocol.duplex import DuplexErrorEvent, RealtimeProtocolError
from shared.redis.boundary import (
    ChatReply,
    ChatRequest,
    CloseRequest,
    CommandRecord,
    InboxMessage,
    OpenRequest,
    RestoreRequest,
    TouchRequest,
    WorkerRegistration,
)
from shared.redis.keys import INBOX_GROUP, KeySchema
from shared.redis.store import SessionStore
from shared.settings import WorkerSettings
from shared.supervised import SupervisedLoop, stop_all

log = logging.getLogger(__name__)

VERSION = "0.1.0"
REPLY_TTL_S = 60
#: the errors a command gets when the session is not held here
NOT_HELD = frozenset({"unknown_session", "session_closed"})


class WorkerProcess(WorkerHost):
    def __init__(
        self, settings: WorkerSettings, redis: Any, runtime: SessionRuntimeConfig | None = None
    ) -> None:
        self.settings = settings
        self.redis = redis  # a RedisHandle
        self.keys = KeySchema(settings.key_prefix)
        self.store = SessionStore(redis.client, self.keys)
        self.plugin = load_plugin(
            settings.plugin, settings.plugin_options(), max_sessions=settings.max_sessions
        )
        self.runtime = runtime or settings.session_policy()
        #: GET /metrics on the health port (services/serve.py hands its registry over)
        self.metrics = WorkerMetrics()
        self.publisher = RedisEventPublisher(
            self.store,
            max_bytes=self.runtime.resume_replay_max_bytes_per_session,
            ttl_s=self.runtime.resume_replay_ttl_s,
            closed_ttl_s=settings.closed_ttl_s,
            sessions_key=self.keys.worker_sessions(settings.worker_id),
        )
        # a frame-clocked model is loaded in `start` (off the loop), its manager with it
        self.manager: SessionManager = None  # type: ignore[assignment]
        if not isinstance(self.plugin, FrameClockedPlugin):
            self._serve_with(
                SessionManager(
                    self.plugin, self.runtime, self.publisher, report_load=self.report_load
                )
            )
        self.inbox = self.keys.inbox(settings.worker_id)
        self.order = CommandOrder()  # which commands apply when (redelivery, moves)
        self._order_lock = asyncio.Lock()  # released commands reach the manager in order
        self._order_wake = asyncio.Event()
        self.drain: Drain | None = None  # set by `stop`: SIGTERM
        # dispatch and the drain looked up at each entry (a test may stand in for either)
        self.reader = InboxReader(
            redis,
            self.store,
            settings.worker_id,
            self.inbox,
            lambda message: self.dispatch(message),
            lambda: self.drain,
        )
        self._loops: list[SupervisedLoop] = []
        self._stopping = asyncio.Event()
        self._last_beat_ok = False
        self.health = (
            HealthServer(settings.health_port, self.readiness) if settings.health_port else None
        )

    @property
    def worker_id(self) -> str:
        return self.settings.worker_id

    def _serve_with(self, manager: SessionManager) -> None:
        self.manager = manager
        self.registration = WorkerRegistration(
            worker_id=self.settings.worker_id,
            model=self.plugin.plugin_id,
            max_sessions=self.runtime.max_sessions,
            capabilities=manager.capabilities.to_realtime(),
            version=VERSION,
        )

    async def _load_frame_model(self, plugin: FrameClockedPlugin) -> None:
        """The one tick-batched stage of a frame-clocked model; admission by its slots: the
        worker takes at most min(max_sessions, the model's slots) sessions."""
        port = await build_frame_stage(plugin, self.runtime.max_sessions, self.metrics.tick)
        slots = min(self.runtime.max_sessions, port.model.slots)
        self.runtime = dataclasses.replace(self.runtime, max_sessions=slots)
        self._serve_with(
            SessionManager(
                plugin, self.runtime, self.publisher, port=port, report_load=self.report_load
            )
        )

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.manager is None and isinstance(self.plugin, FrameClockedPlugin):
            await self._load_frame_model(self.plugin)
        client = self.redis.client
        await self.store.scripts.ensure_loaded(client)
        with contextlib.suppress(redis_errors.ResponseError):  # BUSYGROUP: it exists
            await client.xgroup_create(self.inbox, INBOX_GROUP, id="0", mkstream=True)
        await self._register()
        self.publisher.start()
        self.manager.start()
        if self.health is not None:
            await self.health.start()
        self._loops = [
            SupervisedLoop.every(
                "worker-heartbeat", self.settings.heartbeat_interval_s, self._heartbeat
            ).start()
        ]
        # a previous process under this id left sessions (killed, restarted within the
        # heartbeat TTL): restored before its unhandled inbox entries are read
        await ownership.adopt(self)
        self._loops += [
            SupervisedLoop("worker-inbox", self.reader.consume).start(),
            SupervisedLoop("worker-inbox-ack", self.reader.ack_loop).start(),
            SupervisedLoop("worker-command-order", self._order_loop).start(),
        ]
        log.info(
            "worker %s serving %s (max %d sessions)",
            self.worker_id,
            self.plugin.plugin_id,
            self.runtime.max_sessions,
        )

    async def stop(self) -> None:
        """SIGTERM drain (`services/worker/drain.py`): say `draining` in the registration
        (placement skips it; the beats go on), refuse opens, move every session to another
        worker as it becomes idle (closing, reason `shutdown`, those no worker can take),
        forward what still comes for them; then leave the registry, stop reading, close
        what is left and remove the rest of the registration."""
        first = not self._stopping.is_set()
        self._stopping.set()
        if first and self._loops:
            self.registration = dataclasses.replace(self.registration, draining=True)
            self.drain = Drain(self)
            with contextlib.suppress(Exception):
                await self._beat()
            try:
                await self.drain.run()
            except Exception:
                log.exception("the drain failed; closing the sessions left")
        await stop_all(self._loops)
        with contextlib.suppress(Exception):
            await self.redis.client.zrem(self.keys.workers(), self.worker_id)
        if self.health is not None:
            await self.health.stop()
        with contextlib.suppress(Exception):
            await self.reader.ack_pending(check_empty=True)
        if self.manager is not None:  # None: a frame-clocked model that never loaded
            await self.manager.shutdown("shutdown")
        await self.publisher.stop()
        with contextlib.suppress(Exception):
            await ownership.leave(self)

    async def _register(self) -> None:
        started_at = int(time.time() * 1000)
        self.registration = dataclasses.replace(self.registration, started_at=started_at)
        await self._beat()

    async def _beat(self) -> bool:
        """The whole registration, every beat: a Redis that restarted empty learns it again.
        True when the ZADD added the worker anew (the first beat, or the sweep removed it)."""
        client = self.redis.client
        registration = dataclasses.replace(self.registration, active=self.manager.slots_in_use)
        pipeline = client.pipeline(transaction=False)
        pipeline.hset(self.keys.worker(self.worker_id), mapping=registration.to_hash())
        pipeline.zadd(self.keys.workers(), {self.worker_id: int(time.time() * 1000)})
        _, added = await pipeline.execute()
        self._last_beat_ok = True
        return bool(added)

    def readiness(self) -> tuple[bool, str]:
        """Ready: the plugin is loaded (warm-up happens at construction) and Redis took
        the last heartbeat, so the API pods can place sessions here."""
        if self._stopping.is_set():
            return False, "draining"
        if not self._last_beat_ok:
            return False, "redis unreachable: the last heartbeat failed"
        return True, "ok"

    async def report_load(self) -> None:
        """Placement reads `active`: keep it current between heartbeats."""
        load = WorkerRegistration.load_fields(self.manager.slots_in_use)
        await self.redis.client.hset(self.keys.worker(self.worker_id), mapping=load)

    async def _heartbeat(self) -> None:
        """One beat (every heartbeat interval). A failed one turns readiness false and is
        tried again at the next interval: Redis being away is no failure of the loop."""
        try:
            if await self._beat() and self.manager.owned_sessions():
                await ownership.rejoined(self)
            # marks of sessions no longer held here (closed, expired, moved) go
            self.order.retain(self.manager.session_ids())
        except Exception:
            self._last_beat_ok = False
            log.exception("worker heartbeat failed")

    # ------------------------------------------------------------ inbox (inbox_reader)

    @property
    def read_block_ms(self) -> int:
        return self.reader.block_ms

    @read_block_ms.setter
    def read_block_ms(self, value: int) -> None:  # the drain reads with a short block
        self.reader.block_ms = value

    # ------------------------------------------------------------ command order

    async def _apply(self, session_id: str, released: list[Released]) -> None:
        """Commands `order` released, to the manager in order; a gap before one is told
        to the client first (input_lost). Under the order lock."""
        for command in released:
            try:
                if command.lost:
                    self.manager.report_lost_commands(session_id, command.lost)
                await self.manager.submit(session_id, command.command, mark=command.mark)
            except (DuplexSessionError, RealtimeProtocolError) as exc:
                event_id = getattr(command.command, "event_id", None)
                self._publish_error(session_id, exc, event_id)

    async def release_held(self, session_id: str) -> None:
        """Apply the session's held commands now, without waiting for their gaps (a move)."""
        async with self._order_lock:
            await self._apply(session_id, self.order.release(session_id))

    async def _order_loop(self) -> None:
        """Held commands whose hold window ended are applied (gaps reported)."""
        while True:
            deadline = self.order.next_deadline()
            if deadline is None or deadline > self.order.clock():
                timeout = None if deadline is None else deadline - self.order.clock()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._order_wake.wait()
                self._order_wake.clear()
                continue
            await self.release_expired()

    async def release_expired(self) -> None:
        async with self._order_lock:
            for session_id, commands in self.order.expired():
                await self._apply(session_id, commands)

    async def dispatch(self, message: InboxMessage) -> None:
        sid = message.session_id
        try:
            match message.record():  # a command is rebuilt as the API validated it
                case CommandRecord() as record:
                    mark = (record.attachment, record.seq)
                    async with self._order_lock:
                        await self._apply(sid, self.order.offer(sid, mark, record.command))
                    if self.order.held(sid):
                        self._order_wake.set()
                case OpenRequest(session=session):
                    if self.drain is not None:
                        raise DuplexSessionError(
                            "resource_exhausted", f"worker {self.worker_id} is draining"
                        )
                    await self.manager.open(session, session_id=sid)
                    await self.redis.client.sadd(self.keys.worker_sessions(self.worker_id), sid)
                    await self.report_load()
                case RestoreRequest() as request:
                    await ownership.restore(self, request)
                case CloseRequest(reason=reason):
                    await self.manager.close(sid, reason)  # reports the load itself
                    self.order.forget(sid)
                case TouchRequest():
                    await self.manager.touch(sid)
                case ChatRequest() as request:
                    await self._chat(request)
        except (DuplexSessionError, RealtimeProtocolError) as exc:
            event_id = (
                message.payload.get("event_id") if isinstance(message.payload, dict) else None
            )
            self._publish_error(sid, exc, event_id)

    def _publish_error(
        self, sid: str, exc: DuplexSessionError | RealtimeProtocolError, event_id: str | None
    ) -> None:
        if exc.code in NOT_HELD and self.publisher.owner(sid) is None:
            # not a session of ours (moved away, or the entry of a previous process): an
            # error from here would reach its client unfenced, from a worker it left
            log.info("%s for session %s, which this worker does not hold: dropped", exc.code, sid)
            return
        error = DuplexErrorEvent.for_code(
            exc.code, exc.message, param=exc.param, related_event_id=event_id
        )
        self.publisher.emit(sid, error)

    async def _chat(self, request: ChatRequest) -> None:
        reply_key = self.keys.reply(request.request_id)
        try:
            reply = ChatReply.answer(await self.manager.chat_completion(request.messages))
        except DuplexSessionError as exc:
            reply = ChatReply.failure(exc.code, exc.message)
        except Exception as exc:
            log.exception("chat completion failed")
            reply = ChatReply.failure("internal_error", str(exc))
        pipeline = self.redis.client.pipeline(transaction=False)
        pipeline.rpush(reply_key, reply.to_bytes())
        pipeline.expire(reply_key, REPLY_TTL_S)
        await pipeline.execute()
