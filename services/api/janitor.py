"""Janitor jobs: arq cron jobs that run inside every API pod, each tick executed once.

arq enqueues a cron job under an id made of its name and its tick, so of all
the pods only one runs a given tick. Every second:

- expire_leases: detached sessions past their disconnect grace get
  `session.expired{disconnect_grace_expired}` in their journal, then are closed
  by their worker. (Idle TTL expiry is the worker's own reaper: it sees every
  command.)
- sweep_dead_apis: sessions attached through an API pod whose heartbeat is
  older than the TTL enter disconnect grace, so their clients can resume
  elsewhere.
- sweep_dead_workers: every session of a worker whose heartbeat is older than
  the TTL is re-placed on a live worker from its checkpoint, with the commands
  the dead worker never handled (services/api/failover.py); one that cannot be
  (no checkpoint, no live worker with room, still opening) gets
  `error{worker_lost, retryable}` and `session.closed{worker_lost}` in its
  journal. Then the worker's registration, inbox and session set are removed.

A Redis outage (a failover: seconds without a primary) stops every heartbeat with it, and
the promoted primary holds the scores from before: the first tick after it would find every
worker and pod older than the TTL. So the two dead sweeps judge heartbeats only once Redis
has answered the pod for a heartbeat TTL without a gap (`SteadyRedis`, ticked by the pod's
own heartbeat every second, which also reads the workers' set): a worker or pod is declared
dead only after it had that long to beat and did not, however long the outage was.

On a Redis Cluster, arq (which knows nothing of clusters) talks to the one master that serves
its keys' hash tag. Each restart of arq's run after a failure asks the cluster anew which
master that is, so when that master fails over (a replica promoted at another address) the
sweeps stop only until a restart finds the promoted one.

Failed stage cleanups are retried by each worker's own reaper: the stages live
in the worker process, so no other process can retry them.

The log: what a sweep did (sessions expired, a dead pod or worker and where its sessions
went) is INFO or WARNING; arq's own line for every run of every job (six a second, found
something or not) is DEBUG (`ArqAtDebug`), so an idle pod's log stays quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import arq.worker
from arq import cron
from arq.connections import ArqRedis
from redis.exceptions import RedisError

from services.api.failover import Failover, Outcome
from services.api.live import LiveHub
from services.api.liveness import SteadyRedis
from services.api.worker_client import WorkerClient
from shared.contracts import SessionRuntimeConfig
from shared.ids import EXPIRED_CLOSE_REASON
from shared.outage_log import OutageLog
from shared.protocol.duplex import DuplexErrorEvent, SessionClosed, SessionExpired
from shared.protocol.duplex.errors import WORKER_LOST
from shared.redis.connection import RedisHandle
from shared.redis.inbox_stripes import delete_worker_keys
from shared.redis.keys import KeySchema
from shared.redis.live_message import stamps_seq
from shared.redis.placement import WorkerDirectory
from shared.redis.slot_map import CONNECTION_SETTINGS, SlotMap
from shared.redis.store import PublishItem, SessionStore
from shared.settings import CLOSED_SESSION_TTL_S
from shared.supervised import SupervisedLoop

log = logging.getLogger(__name__)

EVERY_SECOND = set(range(60))


def _said_once_an_outage(job: Callable[..., Awaitable[list[str]]]) -> Callable[..., Any]:
    """A sweep whose Redis is away (a failover) is logged once a run (`OutageLog`) and ends
    quietly: arq would log an ERROR line for each job every second of the outage. Its next
    tick does the work."""
    outage = OutageLog(log, f"the janitor's {job.__name__}")

    async def run(ctx: dict[str, Any] | None = None) -> list[str]:
        try:
            done = await job(ctx)
        except RedisError as exc:
            outage.failed(exc)
            return []
        outage.succeeded()
        return done

    run.__name__ = job.__name__
    return run


class ArqAtDebug(logging.Filter):
    """arq logs at INFO each job it starts and ends, its start and its shutdown: with three
    jobs a second that is six lines a second on an idle pod, routine work no operator acts
    on. This filter makes those records DEBUG (shown only when the process logs at DEBUG:
    `--log-level debug`, DUPLEX_LOG_LEVEL=debug); arq's warnings and errors (a job that
    raised, one that expired) keep their level."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


#: arq's loggers that log routine work at INFO (arq.connections: its pool's "connected")
ARQ_LOGGERS = ("arq.worker", "arq.connections")


def quiet_arq() -> None:
    """Put `ArqAtDebug` on arq's loggers (once, however many janitors start)."""
    for name in ARQ_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ArqAtDebug) for f in logger.filters):
            logger.addFilter(ArqAtDebug())


async def _no_redis_info(*args: Any, **kwargs: Any) -> None:
    """fakeredis has no INFO; arq only logs it."""


_ARQ_KEY_NAMES = (
    "job_key_prefix",
    "in_progress_key_prefix",
    "result_key_prefix",
    "retry_key_prefix",
    "abort_jobs_ss",
)


def _tag_arq_keys(tag: str) -> None:
    """Put every arq key in one cluster slot by prefixing it with a hash tag
    (arq copies its key constants into each module, so each copy is patched)."""
    import arq.connections
    import arq.constants
    import arq.jobs

    for module in (arq.constants, arq.connections, arq.jobs, arq.worker):
        for name in _ARQ_KEY_NAMES:
            value = getattr(module, name, None)
            if isinstance(value, str) and not value.startswith("{"):
                setattr(module, name, tag + value)


class Janitor:
    def __init__(
        self,
        redis: RedisHandle,
        keys: KeySchema,
        store: SessionStore,
        workers: WorkerClient,
        runtime: SessionRuntimeConfig,
        *,
        heartbeat_ttl_s: float,
        disconnect_grace_s: float,
        directory: WorkerDirectory,
        live: LiveHub,
        steady: SteadyRedis | None = None,
    ) -> None:
        self.redis = redis
        self.client = redis.client
        self.keys = keys
        self.store = store
        self.workers = workers
        self.runtime = runtime
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.disconnect_grace_s = disconnect_grace_s
        #: since when Redis has answered without a gap: the pod's heartbeat ticks it every
        #: second (`PodLiveness`), every pod's, whichever pod runs a given sweep; a janitor
        #: without one (alone, in a test) ticks its own in its sweeps
        self.steady = steady if steady is not None else SteadyRedis(heartbeat_ttl_s)
        self._ticks_own = steady is None
        # the moved notices go out through the pod's live hub (it can PUBLISH on a cluster)
        self.failover = Failover(self.client, keys, store, directory, live.publish)
        self._worker: arq.worker.Worker | None = None
        self._loop: SupervisedLoop | None = None
        #: on a cluster: where arq's tag is served, re-read before each run of arq's loop
        self._slots: SlotMap | None = None
        self._node_settings: dict[str, Any] = {}

    # ------------------------------------------------------------ jobs

    def _publish_args(self) -> dict[str, int]:
        runtime = self.runtime
        return {
            "max_bytes": runtime.resume_replay_max_bytes_per_session,
            "ttl_ms": int(runtime.resume_replay_ttl_s * 1000),
            "closed_ttl_ms": int(CLOSED_SESSION_TTL_S * 1000),
        }

    async def expire_leases(self, ctx: dict[str, Any] | None = None) -> list[str]:
        expired = []
        now = int(time.time() * 1000)
        for raw in await self.client.zrangebyscore(self.keys.leases(), "-inf", now):
            session_id = raw.decode()
            worker_id = await self.store.claim_expiry(session_id)
            if worker_id is None:
                continue  # resumed meanwhile, or another tick took it
            event = SessionExpired(session_id=session_id, reason="disconnect_grace_expired")
            await self.store.publish(
                session_id, [PublishItem(event.to_json(), event.wire_type)], **self._publish_args()
            )
            # attachment 0: the expiry speaks for no socket; outside the inbox's budget
            await self.workers.close(worker_id, session_id, 0, EXPIRED_CLOSE_REASON)
            expired.append(session_id)
        if expired:
            log.info("expired %d sessions past their disconnect grace", len(expired))
        return expired

    async def sweep_dead_apis(self, ctx: dict[str, Any] | None = None) -> list[str]:
        detached = []
        cutoff = int((time.time() - self.heartbeat_ttl_s) * 1000)
        grace_ms = int(self.disconnect_grace_s * 1000)
        stale = await self.client.zrangebyscore(self.keys.apis(), "-inf", f"({cutoff}")
        if not self._judging():
            return []  # Redis was away: the pods have not had a TTL to beat since
        for raw in stale:
            dead = raw.decode()
            members = await self.client.smembers(self.keys.api_sessions(dead))
            for member in members:
                session_id = member.decode()
                meta = await self.store.meta(session_id)
                if meta.get("pod") == dead and meta.get("state") == "active":
                    generation = int(meta["attachment_generation"])
                    await self.store.detach(session_id, generation, grace_ms, by="sweep")
                    detached.append(session_id)
            await self.client.delete(self.keys.api_sessions(dead))
            await self.client.zrem(self.keys.apis(), dead)
            log.warning(
                "API pod %s is dead: %d of its sessions wait for a resume", dead, len(detached)
            )
        return detached

    async def sweep_dead_workers(self, ctx: dict[str, Any] | None = None) -> list[str]:
        """Re-place each dead worker's sessions; returns those closed with worker_lost."""
        lost = []
        cutoff = int((time.time() - self.heartbeat_ttl_s) * 1000)
        stale = await self.client.zrangebyscore(self.keys.workers(), "-inf", f"({cutoff}")
        if not self._judging():
            return []  # Redis was away: the workers have not had a TTL to beat since
        for raw in stale:
            dead = raw.decode()
            loss = await self.failover.begin(dead)
            closed = []
            for member in await self.client.smembers(self.keys.worker_sessions(dead)):
                if await self._came_back(dead, cutoff):
                    break  # its new process takes its sessions back itself (`adopt`)
                session_id = member.decode()
                meta = await self.store.meta(session_id)
                outcome = await self.failover.move(loss, session_id, meta)
                if outcome is Outcome.CLOSE and await self._close_lost(dead, session_id, meta):
                    closed.append(session_id)
            await self.failover.finish(loss)
            if await self._came_back(dead, cutoff):
                continue
            await delete_worker_keys(
                self.client, self.keys, dead, await self.store.stripes.of(dead)
            )
            await self.client.zrem(self.keys.workers(), dead)
            log.warning(
                "worker %s is dead: %d sessions moved to other workers (%s), %d closed with "
                "worker_lost",
                dead,
                len(loss.moved),
                ", ".join(f"{sid}->{wid}" for sid, wid in sorted(loss.moved.items())),
                len(closed),
            )
            lost += closed
        return lost

    def _judging(self) -> bool:
        if self._ticks_own:
            self.steady.tick()  # these reads were just answered
        return self.steady.judging()

    async def _came_back(self, dead: str, cutoff: int) -> bool:
        """A worker restarted under the dead one's id while it was swept (a StatefulSet pod
        comes back under its name): its registration, inbox and session set are its own
        now and are not deleted (it took back what the sweep had not moved: `adopt`)."""
        score = await self.client.zscore(self.keys.workers(), dead)
        if score is None or score < cutoff:
            return False
        log.warning("worker %s came back while it was swept; its keys are left to it", dead)
        return True

    async def _close_lost(self, dead: str, session_id: str, meta: dict[str, str]) -> bool:
        """error{worker_lost} + session.closed{worker_lost}, fenced on the owner generation
        read with `meta`: a session another sweep moved meanwhile is not closed (False)."""
        error = DuplexErrorEvent.for_code(
            WORKER_LOST,
            f"worker {dead} stopped answering and no worker could take the session; "
            "open a new session",
        )
        closed = SessionClosed(session_id=session_id, reason=WORKER_LOST)
        items = [PublishItem(e.to_json(), e.wire_type) for e in (error, closed)]
        owner = meta.get("owner_generation")
        seqs = await self.store.publish(
            session_id,
            items,
            owner_generation=int(owner) if owner else None,
            stamp_seq=stamps_seq(meta),
            **self._publish_args(),
        )
        if seqs == [-2]:
            return False
        await self.client.zrem(self.keys.leases(), session_id)
        return True

    # ------------------------------------------------------------ arq

    async def _arq_pool(self) -> tuple[ArqRedis, str]:
        """arq's connection and queue name. On Redis Cluster, arq's keys get one hash
        tag (arq itself knows nothing of clusters) and arq talks to the node that
        serves that tag's slot now: asked of the cluster each time (`_cluster_arq_pool`)."""
        if self.redis.server is not None:
            arq.worker.log_redis_info = _no_redis_info  # type: ignore[assignment]
        if not self.redis.cluster:
            # a client of arq's own, on a pool of its own: arq's close() disconnects the
            # pool it was given, and the pod's (its live hub's subscription on it) must
            # outlive the janitor; with Sentinel, one that follows the primary as the pod's does
            return self.redis.client_of_its_own(ArqRedis), self.keys.arq_queue()
        tag = "{" + self.keys.arq_queue() + "}"
        _tag_arq_keys(tag)
        return await self._cluster_arq_pool(tag), tag + ":queue"

    async def _cluster_arq_pool(self, tag: str) -> ArqRedis:
        """A client to the master that serves `tag`'s slot, as the cluster says now: after
        a failover that is the promoted replica. The slot map is our own (`SlotMap`) and
        read afresh: the pod's cluster client may not have noticed the failover yet (arq
        polls every 0.2 s, the pod's own commands may touch other shards only), and a forced
        refresh of that client's map would drop every connection of the pod, commands in
        flight included (redis-py replaces each node's object and disconnects the old)."""
        if self._slots is None:
            await self.client.initialize()  # the nodes it knows are the seeds
            nodes = [*self.client.nodes_manager.startup_nodes.values(), *self.client.get_nodes()]
            kwargs = self.client.get_connection_kwargs()
            self._node_settings = {
                name: kwargs[name] for name in CONNECTION_SETTINGS if kwargs.get(name)
            }
            self._slots = SlotMap(
                [(node.host, int(node.port)) for node in nodes], self._node_settings
            )
        await self._slots.refresh()
        host, port = self._slots.owner(tag)
        return ArqRedis(host=host, port=port, **self._node_settings)

    def _arq_worker(self, pool: ArqRedis, queue_name: str) -> arq.worker.Worker:
        # A cron job's id is its name and its second (`arq:job:<name>:<ms>`), whatever the
        # queue: the names carry the key prefix, so that two deployments sharing one Redis
        # (or a test's two clusters) do not take each other's ticks, each running only the
        # sweeps whose id it enqueued first
        jobs = [
            cron(
                _said_once_an_outage(job),
                name=f"{self.keys.prefix}:{job.__name__}",
                second=EVERY_SECOND,
                run_at_startup=False,
            )
            for job in (self.expire_leases, self.sweep_dead_apis, self.sweep_dead_workers)
        ]
        return arq.worker.Worker(
            functions=[],
            cron_jobs=jobs,
            redis_pool=pool,
            handle_signals=False,
            queue_name=queue_name,
            keep_result=0,
            poll_delay=0.2,
            max_jobs=4,
            on_startup=self._arq_connected,
        )

    async def _arq_connected(self, ctx: dict[str, Any]) -> None:
        """arq's run has reached its Redis (arq asks it for INFO before this): the end of
        a run of failed restarts, if there was one, is logged."""
        if self._loop is not None:
            self._loop.outage.succeeded()

    async def _run_arq(self) -> None:
        """One run of arq's loop; the supervising loop starts another, after a backoff
        pause, when it fails (Redis gone, for one). Each run gets a new arq worker and
        client: on a cluster, to the node that serves arq's tag now (the last run's was
        pinned to the address of a master that may have failed over, which left the janitor
        dead for the whole deployment); everywhere, because arq 0.28 keeps a job slot and
        its count when a Redis error hits its job pipeline, so a worker run again after
        `max_jobs` such failures would take no job ever again."""
        await self._close_arq()
        pool, queue_name = await self._arq_pool()
        self._worker = self._arq_worker(pool, queue_name)
        await self._worker.async_run()

    async def _close_arq(self) -> None:
        """Close arq's worker (its running jobs are cancelled) and its client's pool."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        try:
            await worker.close()
        except asyncio.CancelledError:
            # arq's close() cancels the jobs of a tick still running, then gathers them:
            # their CancelledError must not end this stop (and the pod's) half-way, nor the
            # supervised run that replaces a failed worker. Our own cancellation goes on.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
        except Exception:
            pass  # its Redis is gone (arq deletes its health key before closing the pool)
        finally:
            if worker.pool is not None:  # close() stopped before closing its pool
                with contextlib.suppress(Exception):
                    await worker.pool.aclose(close_connection_pool=True)

    async def start(self) -> None:
        quiet_arq()
        # arq's run loop, restarted after a pause should it fail (Redis gone, for one);
        # each run makes its client first (on a cluster, to the node serving arq's tag now)
        self._loop = SupervisedLoop("janitor", self._run_arq).start()

    async def stop(self) -> None:
        if self._loop is not None:
            await self._loop.stop()
        await self._close_arq()
