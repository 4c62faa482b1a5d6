"""The worker process: registry + heartbeat, the inbox consumer, the session manager.

The composition root of a worker: it builds the session table (`control/table.py`, one
record per session), the publisher, the session manager and its moves, the ownership checks
and, on SIGTERM, the drain, and hands each exactly what it uses.

The inbox consumer (`inbox_reader`) reads the worker's inbox stream, unpacks each entry and
dispatches its messages in order; entries are acknowledged in batches after dispatch.
Commands carry (attachment generation, seq): a redelivered one is dropped, and a session
moved here gets its commands in order (its record's `CommandOrder`). Entries and the
registration hash are records of `shared.redis.boundary`; the long-lived loops run
supervised (`shared.supervised`). SIGTERM drains (`drain`); restores and the zombie check
are in `ownership`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

import orjson
from redis import exceptions as redis_errors

from services.worker.control.command_order import Released
from services.worker.control.manager import SessionManager
from services.worker.control.table import SessionTable
from services.worker.drain import DRAIN_READ_BLOCK_MS, Drain
from services.worker.engine.command_marks import Mark
from services.worker.health import HealthServer
from services.worker.inbox_reader import InboxReader
from services.worker.metrics import WorkerMetrics
from services.worker.ownership import Ownership
from services.worker.plugins import build_frame_stage, load_plugin
from services.worker.publisher import RedisEventPublisher
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.contracts import DuplexSessionError, FrameClockedPlugin, SessionRuntimeConfig
from shared.outage_log import OutageLog
from shared.protocol.duplex import DuplexCommand, DuplexErrorEvent, RealtimeProtocolError
from shared.redis.boundary import (
    ChatReply,
    ChatRequest,
    CloseRequest,
    CommandRecord,
    ControlNotice,
    InboxMessage,
    OpenRequest,
    RestoreRequest,
    TouchRequest,
    UnknownCommand,
    WorkerRegistration,
)
from shared.redis.inbox_stripes import ANNOUNCED_TTL_S, InboxStripes, announce, create_groups
from shared.redis.keys import KeySchema
from shared.redis.store import SessionStore
from shared.settings import WorkerSettings
from shared.supervised import SupervisedLoop, stop_all

log = logging.getLogger(__name__)

VERSION = "0.1.0"
REPLY_TTL_S = 60
#: how often a restore's progress goes to its session's hash (`duplex sessions show`)
RESTORE_REPORT_S = 0.5
#: the errors a command gets when the session is not held here
NOT_HELD = frozenset({"unknown_session", "session_closed"})


class WorkerProcess:
    def __init__(
        self, settings: WorkerSettings, redis: Any, runtime: SessionRuntimeConfig | None = None
    ) -> None:
        self.settings = settings
        self.redis = redis  # a RedisHandle
        self.keys = KeySchema(settings.key_prefix)
        self.store = SessionStore(
            redis.client,
            self.keys,
            # an embedded fakeredis has no replica (nor WAIT)
            replica_acks=settings.redis_replica_acks if redis.server is None else 0,
            replica_ack_timeout_ms=settings.redis_replica_ack_timeout_ms,
        )
        self.plugin = load_plugin(
            settings.plugin, settings.plugin_options(), max_sessions=settings.max_sessions
        )
        self.runtime = runtime or settings.session_policy()
        #: GET /metrics on the health port (services/serve.py hands its registry over)
        self.metrics = WorkerMetrics()
        #: every session this worker holds, one record each
        self.table = SessionTable(self.runtime.max_sessions)
        self.publisher = RedisEventPublisher(
            self.store,
            self.table,
            max_bytes=self.runtime.resume_replay_max_bytes_per_session,
            ttl_s=self.runtime.resume_replay_ttl_s,
            closed_ttl_s=settings.closed_ttl_s,
            sessions_key=self.keys.worker_sessions(settings.worker_id),
            worker_id=settings.worker_id,
        )
        #: its inbox's stripes (one per Redis Cluster master), chosen in `start`
        self.stripes = InboxStripes()
        # a frame-clocked model is loaded in `start` (off the loop), its manager with it
        self._manager: SessionManager | None = None
        self._ownership: Ownership | None = None
        if not isinstance(self.plugin, FrameClockedPlugin):
            self._serve_with(
                SessionManager(
                    self.plugin,
                    self.runtime,
                    self.publisher,
                    table=self.table,
                    report_load=self.report_load,
                )
            )
        self._order_lock = asyncio.Lock()  # released commands reach the manager in order
        self._order_wake = asyncio.Event()
        self.drain: Drain | None = None  # set by `stop`: SIGTERM
        #: a reader per inbox stripe; stripe 0's from the start, the others' once chosen
        self.readers = [self._reader(0)]
        self._loops: list[SupervisedLoop] = []
        self._beat_outage = OutageLog(log, "worker heartbeat")
        self._registration_outage = OutageLog(log, "worker registration (its hash)")
        #: a frame-clocked model's stage: its restores' progress goes to their hashes
        self._frame_port: TickBatchedStagePort | None = None
        self._stopping = asyncio.Event()
        self._last_beat_ok = False
        self.health = (
            HealthServer(settings.health_port, self.readiness) if settings.health_port else None
        )

    @property
    def worker_id(self) -> str:
        return self.settings.worker_id

    @property
    def reader(self) -> InboxReader:
        """The reader of inbox stripe 0 (the only one on a single Redis)."""
        return self.readers[0]

    def _reader(self, stripe: int) -> InboxReader:
        # dispatch and the drain looked up at each entry (a test may stand in for either)
        return InboxReader(
            self.redis,
            self.store,
            self.worker_id,
            self.keys.inbox(self.worker_id, stripe),
            lambda message: self.dispatch(message),
            lambda: self.drain,
            stripe=stripe,
        )

    @property
    def manager(self) -> SessionManager:
        if self._manager is None:
            raise RuntimeError("the worker's model is not loaded yet (`start` loads it)")
        return self._manager

    @property
    def ownership(self) -> Ownership:
        if self._ownership is None:
            raise RuntimeError("the worker's model is not loaded yet (`start` loads it)")
        return self._ownership

    def _serve_with(self, manager: SessionManager) -> None:
        self._manager = manager
        self.publisher.serve(manager.moves)
        self._ownership = Ownership(
            self.worker_id,
            self.store,
            manager.moves,
            self.publisher,
            notify=self.notify,
            report_load=self.report_load,
        )
        self.registration = WorkerRegistration(
            worker_id=self.settings.worker_id,
            model=self.plugin.plugin_id,
            max_sessions=self.runtime.max_sessions,
            capabilities=manager.builder.capabilities.to_realtime(),
            version=VERSION,
        )

    async def _load_frame_model(self, plugin: FrameClockedPlugin) -> None:
        """The one tick-batched stage of a frame-clocked model; admission by its slots: the
        worker takes at most min(max_sessions, the model's slots) sessions."""
        port = await build_frame_stage(plugin, self.runtime.max_sessions, self.metrics.tick)
        self._frame_port = port
        slots = min(self.runtime.max_sessions, port.model.slots)
        self.runtime = dataclasses.replace(self.runtime, max_sessions=slots)
        self._serve_with(
            SessionManager(
                plugin,
                self.runtime,
                self.publisher,
                table=self.table,
                port=port,
                report_load=self.report_load,
            )
        )

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._manager is None and isinstance(self.plugin, FrameClockedPlugin):
            await self._load_frame_model(self.plugin)
        client = self.redis.client
        await self.store.scripts.ensure_loaded(client)
        # the stripes its id announced before (a process under this id chose them: other
        # processes may have them cached), else new ones (shared/redis/inbox_stripes.py)
        self.stripes = await announce(client, self.keys, self.worker_id)
        self.ownership.stripes = self.stripes
        self.store.stripes.learn(self.worker_id, self.stripes)
        self.readers += [self._reader(stripe) for stripe in self.stripes.stripes if stripe]
        await create_groups(client, self.keys, self.worker_id, self.stripes)
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
        if self._frame_port is not None:
            self._loops.append(
                SupervisedLoop.every(
                    "restore-progress", RESTORE_REPORT_S, self.report_restores
                ).start()
            )
        # a previous process under this id left sessions (killed, restarted within the
        # heartbeat TTL): restored before its unhandled inbox entries are read
        await self.ownership.adopt()
        for reader in self.readers:
            name = f"worker-inbox-{reader.stripe}" if reader.stripe else "worker-inbox"
            self._loops += [
                SupervisedLoop(name, reader.consume).start(),
                SupervisedLoop(f"{name}-ack", reader.ack_loop).start(),
            ]
        self._loops.append(SupervisedLoop("worker-command-order", self._order_loop).start())
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
            self.drain = self._new_drain()
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
        for reader in self.readers:
            with contextlib.suppress(Exception):
                await reader.ack_pending(check_empty=True)
        if self._manager is not None:  # None: a frame-clocked model that never loaded
            await self._manager.shutdown("shutdown")
        await self.publisher.stop()
        if self._ownership is not None:
            with contextlib.suppress(Exception):
                await self._ownership.leave()

    async def _register(self) -> None:
        started_at = int(time.time() * 1000)
        self.registration = dataclasses.replace(self.registration, started_at=started_at)
        await self._beat()

    async def _beat(self) -> bool:
        """The whole registration, every beat: a Redis that restarted empty learns it again.
        True when the ZADD added the worker anew (the first beat, or the sweep removed it)."""
        client = self.redis.client
        registration = dataclasses.replace(self.registration, active=self.table.slots_in_use)
        registry = {self.worker_id: int(time.time() * 1000)}
        if not self.redis.cluster:
            pipeline = client.pipeline(transaction=False)
            pipeline.hset(self.keys.worker(self.worker_id), mapping=registration.to_hash())
            pipeline.zadd(self.keys.workers(), registry)
            _, added = await pipeline.execute()
            self._last_beat_ok = True
            return bool(added)
        # on a cluster the hash (the worker's own tag) and the registry are on two masters,
        # each call on its own: a master of the worker's tag failing over must not stop the
        # beat the dead-worker sweep reads (the registry's score), or every session of a
        # healthy worker would be moved for it
        stored, added, _ = await asyncio.gather(
            client.hset(self.keys.worker(self.worker_id), mapping=registration.to_hash()),
            client.zadd(self.keys.workers(), registry),
            # the stripes' announcement lives a week past the id's last beat
            client.expire(self.keys.inbox_stripes(self.worker_id), ANNOUNCED_TTL_S),
            return_exceptions=True,
        )
        if isinstance(added, BaseException):
            raise added
        self._last_beat_ok = True
        if isinstance(stored, BaseException):
            # the registration waits for the next beat; the beat itself went through
            self._registration_outage.failed(stored, traceback=False)
        else:
            self._registration_outage.succeeded()
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
        load = WorkerRegistration.load_fields(self.table.slots_in_use)
        await self.redis.client.hset(self.keys.worker(self.worker_id), mapping=load)

    async def report_restores(self) -> None:
        """Each restore's progress into its session's hash (`restore`, JSON: frames to
        replay, replayed, seconds, pace), every `RESTORE_REPORT_S` while it replays and
        once when it ends, fenced on the owner generation held here. A write that fails
        is a figure missed, not a failure: the next report writes the newer one."""
        port = self._frame_port
        if port is None:
            return
        writes = []
        for progress in port.restore_progress(forget_done=True):
            generation = self.table.owner_generation(progress.session_id)
            if generation is not None:
                data = orjson.dumps(progress.to_json_dict())
                writes.append((progress.session_id, generation, data))
        try:
            await self.store.write_restore_progress(writes)
        except redis_errors.RedisError:
            log.warning("writing %d restores' progress failed", len(writes), exc_info=True)

    async def _heartbeat(self) -> None:
        """One beat (every heartbeat interval). A failed one turns readiness false and is
        tried again at the next interval: Redis being away is no failure of the loop."""
        try:
            if await self._beat() and self.table.live():
                await self.ownership.rejoined()
        except Exception as exc:
            self._last_beat_ok = False
            self._beat_outage.failed(exc)  # once per outage, the rest counted
        else:
            self._beat_outage.succeeded()

    def _new_drain(self) -> Drain:
        for reader in self.readers:
            reader.block_ms = DRAIN_READ_BLOCK_MS  # so the linger ends soon after it may
        return Drain(
            self.worker_id,
            self.store,
            self.manager,
            self.publisher,
            drain_timeout_s=self.settings.drain_timeout_s,
            heartbeat_ttl_s=self.settings.heartbeat_ttl_s,
            dispatch=self.dispatch,
            release_held=self.release_held,
            notify=self.notify,
            stripes=self.stripes.stripes,
        )

    async def notify(self, session_id: str, notice: ControlNotice) -> None:
        """A control notice on the session's live channel (SPUBLISH on a cluster: to the
        shard that owns the channel, where its API pods listen)."""
        await self.redis.publish(self.keys.live(session_id), notice.to_bytes())

    # ------------------------------------------------------------ command order

    async def _apply(self, session_id: str, released: list[Released]) -> None:
        """Commands a session's order released, to the manager in order; a gap before one
        is told to the client first (input_lost). Under the order lock."""
        for command in released:
            try:
                if command.lost:
                    self.manager.moves.report_lost_commands(session_id, command.lost)
                await self.manager.submit(session_id, command.command, mark=command.mark)
            except (DuplexSessionError, RealtimeProtocolError) as exc:
                self._publish_error(session_id, exc, command.command.event_id)

    async def apply_command(self, session_id: str, mark: Mark, command: DuplexCommand) -> None:
        """A command read from the inbox: applied now, held for its gap, or dropped as a
        redelivery, by the session's command order. A session not held here has none: the
        command goes to the manager, which refuses it (`unknown_session`)."""
        async with self._order_lock:
            record = self.table.get(session_id)
            if record is None:
                released = [Released(mark, command)]
            else:
                released = record.order.offer(mark, command)
            await self._apply(session_id, released)
            if record is not None and record.order.held:
                self._order_wake.set()

    async def release_held(self, session_id: str) -> None:
        """Apply the session's held commands now, without waiting for their gaps (a move)."""
        async with self._order_lock:
            record = self.table.get(session_id)
            if record is not None:
                await self._apply(session_id, record.order.release())

    async def _order_loop(self) -> None:
        """Held commands whose hold window ended are applied (gaps reported)."""
        while True:
            deadline = self.table.next_hold_deadline()
            now = self.table.clock()
            if deadline is None or deadline > now:
                timeout = None if deadline is None else deadline - now
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._order_wake.wait()
                self._order_wake.clear()
                continue
            await self.release_expired()

    async def release_expired(self) -> None:
        async with self._order_lock:
            for record in self.table:
                released = record.order.expired()
                if released:
                    await self._apply(record.session_id, released)

    async def dispatch(self, message: InboxMessage) -> None:
        sid = message.session_id
        try:
            match message:  # typed as decoded: a command is the one the API pod validated
                case CommandRecord() as record:
                    mark = (record.attachment, record.seq)
                    await self.apply_command(sid, mark, record.command)
                case UnknownCommand(command_type=command_type):  # a newer API pod's
                    raise RealtimeProtocolError(
                        "unknown_event", f"unknown client event type {command_type!r}", param="type"
                    )
                case OpenRequest(session=session):
                    if self.drain is not None:
                        raise DuplexSessionError(
                            "resource_exhausted", f"worker {self.worker_id} is draining"
                        )
                    await self._open(sid, session)
                case RestoreRequest() as request:
                    await self.ownership.restore(request)
                case CloseRequest(reason=reason):
                    await self.manager.close(sid, reason)  # reports the load itself
                case TouchRequest():
                    await self.manager.touch(sid)
                case ChatRequest() as request:
                    await self._chat(request)
        except (DuplexSessionError, RealtimeProtocolError) as exc:
            match message:  # the error answers the command's own event_id
                case CommandRecord(command=command):
                    event_id = command.event_id
                case UnknownCommand(event_id=event_id):
                    pass
                case _:
                    event_id = None
            self._publish_error(sid, exc, event_id)

    async def _open(self, sid: str, session: Any) -> None:
        """Admit and serve a new session, listed in the worker's session set first.

        The set is what the dead-worker sweep (services/api/janitor.py), `adopt` and `leave`
        read to find this worker's sessions; a session served but missing from it is
        neither failed over nor closed if the worker dies. So it is added BEFORE the open:
        every reader of the set checks each member against the session's hash (worker,
        owner generation, state) and skips what is not an active session of this worker,
        so an entry ahead of the open, or one left by an open that failed, is harmless
        (the publisher leaves closed ones there the same way), while a missing one is not.
        A worker that dies mid-open is even better off: the sweep finds the session still
        `opening` and closes it with worker_lost, so its opener hears that instead of
        waiting out its timeout. A SADD that fails refuses the open (the opener hears
        internal_error) before anything is served; after the open, nothing can fail."""
        sessions = self.keys.worker_sessions(self.worker_id)
        try:
            await self.redis.client.sadd(sessions, sid)
        except Exception as exc:
            log.warning("session %s: listing it in %s failed", sid, sessions, exc_info=True)
            raise DuplexSessionError(
                "internal_error",
                f"worker {self.worker_id} could not register the session ({exc}); open it again",
            ) from exc
        try:
            await self.manager.open(session, session_id=sid)
        except Exception:
            # refused: its entry goes (best effort: a stale one is skipped by every reader),
            # unless the session is one this worker serves already (a second open of it)
            if self.table.owner_generation(sid) is None:
                with contextlib.suppress(Exception):
                    await self.redis.client.srem(sessions, sid)
            raise
        await self.report_load()

    def _publish_error(
        self, sid: str, exc: DuplexSessionError | RealtimeProtocolError, event_id: str | None
    ) -> None:
        error = DuplexErrorEvent.for_code(
            exc.code, exc.message, param=exc.param, related_event_id=event_id
        )
        if self.table.owner_generation(sid) is not None:
            self.publisher.emit(sid, error)  # fenced on the owner generation held here
        elif exc.code in NOT_HELD:
            # not a session of ours (moved away, or the entry of a previous process): an
            # error from here would reach its client unfenced, from a worker it left
            log.info("%s for session %s, which this worker does not hold: dropped", exc.code, sid)
        else:  # an open refused: the client waits for this error on the live channel
            self.publisher.emit_unowned(sid, error)

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
