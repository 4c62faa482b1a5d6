"""The worker process: registry + heartbeat, the inbox consumer, the session manager.

One consumer task reads the worker's inbox stream with XREADGROUP BLOCK and
dispatches each entry in order; entries are acknowledged after dispatch.
Commands carry (attachment generation, seq) from the API connection that sent
them, so a redelivered command is recognised and dropped. Every entry and the
registration hash are records of `shared.redis.boundary`; the long-lived loops
(heartbeat, inbox, ack) run supervised (`shared.supervised`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from redis import exceptions as redis_errors

from services.worker.health import HealthServer
from services.worker.plugins import load_plugin
from services.worker.publisher import RedisEventPublisher
from services.worker.session.manager import SessionManager
from shared.backoff import Backoff
from shared.contracts import DuplexSessionError, SessionRuntimeConfig
from shared.protocol.duplex import DuplexErrorEvent, RealtimeProtocolError
from shared.redis.boundary import (
    ChatReply,
    ChatRequest,
    CloseRequest,
    CommandRecord,
    InboxMessage,
    OpenRequest,
    TouchRequest,
    WorkerRegistration,
    entry_bytes,
)
from shared.redis.keys import INBOX_GROUP, KeySchema
from shared.redis.store import SessionStore
from shared.settings import WorkerSettings
from shared.supervised import SupervisedLoop, stop_all

log = logging.getLogger(__name__)

VERSION = "0.1.0"
READ_BLOCK_MS = 1000
READ_COUNT = 256
REPLY_TTL_S = 60


class WorkerProcess:
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
        self.publisher = RedisEventPublisher(
            self.store,
            max_bytes=self.runtime.resume_replay_max_bytes_per_session,
            ttl_s=self.runtime.resume_replay_ttl_s,
            closed_ttl_s=settings.closed_ttl_s,
            sessions_key=self.keys.worker_sessions(settings.worker_id),
        )
        self.manager = SessionManager(self.plugin, self.runtime, self.publisher)
        self.registration = WorkerRegistration(
            worker_id=settings.worker_id,
            model=self.plugin.plugin_id,
            max_sessions=self.runtime.max_sessions,
            capabilities=self.manager.capabilities.to_realtime(),
            version=VERSION,
        )
        self.inbox = self.keys.inbox(settings.worker_id)
        self._applied: dict[str, tuple[int, int]] = {}  # session -> last (attachment, seq)
        self._loops: list[SupervisedLoop] = []
        # where the next XREADGROUP starts: first our own pending entries (a restart), then
        # new ones; kept here so a restarted consume loop does not dispatch handled ones again
        self._read_from = "0"
        # inbox entries handled, not yet acked and deleted: (entry id, size in bytes)
        self._unacked: list[tuple[bytes, int]] = []
        self._ack_wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._last_beat_ok = False
        self.health = (
            HealthServer(settings.health_port, self.readiness) if settings.health_port else None
        )

    @property
    def worker_id(self) -> str:
        return self.settings.worker_id

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
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
            ).start(),
            SupervisedLoop("worker-inbox", self._consume_loop).start(),
            SupervisedLoop("worker-inbox-ack", self._ack_loop).start(),
        ]
        log.info(
            "worker %s serving %s (max %d sessions)",
            self.worker_id,
            self.plugin.plugin_id,
            self.runtime.max_sessions,
        )

    async def stop(self) -> None:
        """SIGTERM drain: leave the registry (no new sessions are placed here), stop
        reading, end in-flight responses and close every session with reason
        `shutdown` (clients see why), then remove the rest of the registration."""
        self._stopping.set()
        if self.health is not None:
            await self.health.stop()
        with contextlib.suppress(Exception):
            await self.redis.client.zrem(self.keys.workers(), self.worker_id)
        await stop_all(self._loops)
        with contextlib.suppress(Exception):
            await self._ack_pending()
        await self.manager.shutdown("shutdown")
        await self.publisher.stop()
        with contextlib.suppress(Exception):
            # the inbox too: its sessions are closed, and nothing reads it again
            await self.redis.client.delete(
                self.keys.worker(self.worker_id),
                self.keys.worker_sessions(self.worker_id),
                self.inbox,
                self.keys.inbox_bytes(self.worker_id),
            )

    async def _register(self) -> None:
        started_at = int(time.time() * 1000)
        self.registration = dataclasses.replace(self.registration, started_at=started_at)
        await self._beat()

    async def _beat(self) -> None:
        """The whole registration, every beat: a Redis that restarted empty learns it again."""
        client = self.redis.client
        registration = dataclasses.replace(self.registration, active=self.manager.slots_in_use)
        pipeline = client.pipeline(transaction=False)
        pipeline.hset(self.keys.worker(self.worker_id), mapping=registration.to_hash())
        pipeline.zadd(self.keys.workers(), {self.worker_id: int(time.time() * 1000)})
        await pipeline.execute()
        self._last_beat_ok = True

    def readiness(self) -> tuple[bool, str]:
        """Ready: the plugin is loaded (warm-up happens at construction) and Redis took
        the last heartbeat, so the API pods can place sessions here."""
        if self._stopping.is_set():
            return False, "draining"
        if not self._last_beat_ok:
            return False, "redis unreachable: the last heartbeat failed"
        return True, "ok"

    async def _report_load(self) -> None:
        """Placement reads `active`: keep it current between heartbeats."""
        load = WorkerRegistration.load_fields(self.manager.slots_in_use)
        await self.redis.client.hset(self.keys.worker(self.worker_id), mapping=load)

    async def _heartbeat(self) -> None:
        """One beat (every heartbeat interval). A failed one turns readiness false and is
        tried again at the next interval: Redis being away is no failure of the loop."""
        try:
            await self._beat()
            self._forget_closed_sessions()
        except Exception:
            self._last_beat_ok = False
            log.exception("worker heartbeat failed")

    def _forget_closed_sessions(self) -> None:
        """Redelivery marks of sessions this worker no longer holds (closed by their
        client, expired) are dropped, so the map does not grow for ever."""
        live = set(self.manager.session_ids())
        for session_id in [sid for sid in self._applied if sid not in live]:
            del self._applied[session_id]

    # ------------------------------------------------------------ inbox

    async def _consume_loop(self) -> None:
        """Read and dispatch for ever. Redis errors are retried here (NOGROUP: the group is
        made again; others after a backoff); what escapes restarts it under its supervisor,
        from `_read_from`, so entries already dispatched are not dispatched again."""
        reader = self.redis.new_client()
        backoff = Backoff()
        while True:
            try:
                reply = await reader.xreadgroup(
                    INBOX_GROUP,
                    self.worker_id,
                    {self.inbox: self._read_from},
                    count=READ_COUNT,
                    block=READ_BLOCK_MS,
                )
            except asyncio.CancelledError:
                raise
            except redis_errors.ResponseError as exc:
                if "NOGROUP" in str(exc):
                    # the group is gone (Redis restarted empty): make it again and go on
                    with contextlib.suppress(Exception):
                        await self.redis.client.xgroup_create(
                            self.inbox, INBOX_GROUP, id="0", mkstream=True
                        )
                else:
                    log.exception("reading the inbox failed; retrying")
                    await asyncio.sleep(backoff.next_delay())
                continue
            except Exception:
                # connection lost: redis-py reconnects on the next call; back off meanwhile
                log.warning("reading the inbox failed; retrying", exc_info=True)
                await asyncio.sleep(backoff.next_delay())
                continue
            backoff.reset()
            entries = reply[0][1] if reply else []
            if not entries and self._read_from != ">":  # past our pending entries: new ones
                self._read_from = ">"
                continue
            for entry_id, fields in entries:
                if self._read_from != ">":
                    # reading our own pending entries (a restart): go on past this one, or
                    # the next read returns it again until the ack loop's XACK lands, and
                    # an open, close or chat (not deduplicated by seq) would run twice
                    self._read_from = entry_id
                try:
                    await self.dispatch(InboxMessage.from_fields(fields))
                except Exception:
                    log.exception("inbox entry %r failed", entry_id)
            if entries:
                self._unacked.extend(
                    (entry_id, entry_bytes(fields)) for entry_id, fields in entries
                )
                self._ack_wake.set()

    async def _ack_loop(self) -> None:
        """Acknowledge and delete handled entries off the read path: awaiting that before
        the next XREADGROUP put a Redis round trip in front of every command
        (bench/profile). Deleting them is what frees an append's audio in Redis (an XACK
        alone leaves the entry in the stream until MAXLEN trims it). An ack that is late
        or lost only leaves an entry pending, which a restarted worker skips (`_fresh`) or
        whose session is gone with the old process."""
        backoff = Backoff()
        while True:
            await self._ack_wake.wait()
            self._ack_wake.clear()
            try:
                await self._ack_pending()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("acknowledging inbox entries failed; retrying", exc_info=True)
                await asyncio.sleep(backoff.next_delay())
                self._ack_wake.set()
                continue
            backoff.reset()

    async def _ack_pending(self) -> None:
        handled, self._unacked = self._unacked, []
        if not handled:
            return
        try:
            await self.store.inbox_ack(self.worker_id, handled)
        except BaseException:
            # all of them again: a batch that did go through deletes nothing twice
            self._unacked = handled + self._unacked
            raise

    def _fresh(self, record: CommandRecord) -> bool:
        """False for a command already applied (redelivery)."""
        mark = (record.attachment, record.seq)
        if mark <= self._applied.get(record.session_id, (0, 0)):
            return False
        self._applied[record.session_id] = mark
        return True

    async def dispatch(self, message: InboxMessage) -> None:
        sid = message.session_id
        try:
            match message.record():  # a command is rebuilt as the API validated it
                case CommandRecord() as record:
                    if self._fresh(record):
                        await self.manager.submit(sid, record.command)
                case OpenRequest(session=session):
                    await self.manager.open(session, session_id=sid)
                    await self.redis.client.sadd(self.keys.worker_sessions(self.worker_id), sid)
                    await self._report_load()
                case CloseRequest(reason=reason):
                    await self.manager.close(sid, reason)
                    self._applied.pop(sid, None)
                    await self._report_load()
                case TouchRequest():
                    await self.manager.touch(sid)
                case ChatRequest() as request:
                    await self._chat(request)
        except (DuplexSessionError, RealtimeProtocolError) as exc:
            event_id = (
                message.payload.get("event_id") if isinstance(message.payload, dict) else None
            )
            error = DuplexErrorEvent.for_code(exc.code, exc.message, related_event_id=event_id)
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
