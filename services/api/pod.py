"""The API pod's composition root: every collaborator built from settings and one Redis
handle, wired, started and stopped in one readable order.

Nothing here is reached through: each collaborator gets exactly the collaborators it
uses in its constructor. Pod-wide pieces are built once (the session store and its
scripts, the live hub, the worker directory, the inbox writer behind `WorkerClient`,
the liveness heartbeat, the janitor, metrics); per socket, `connection()` builds an
`Attachment`, a `Delivery` and the `RealtimeConnection` that drives them.

Start order: scripts loaded, live hub subscribed, first heartbeat, janitor, loop-lag
watchdog. Stop order is the reverse, then the inbox writer (what is still queued fails
in its callers) and the pod's registration.
"""

from __future__ import annotations

import contextlib
import logging

from starlette.websockets import WebSocket

from services.api.attachment import Attachment
from services.api.chat import ChatCompletions
from services.api.connection import RealtimeConnection
from services.api.delivery import Delivery, SessionParts, SessionView
from services.api.door import Door
from services.api.inbox_writer import InboxWriter
from services.api.janitor import Janitor
from services.api.live import LiveFeed, LiveHub
from services.api.live_sessions import LiveSessionsEndpoint
from services.api.liveness import PodLiveness
from services.api.map_realtime import MapRealtimeEndpoint
from services.api.metrics import ApiMetrics
from services.api.moshi_chat import MoshiChatEndpoint
from services.api.output_queue import OutputQueue
from services.api.realtime import RealtimeEndpoint
from services.api.security import KeyChecker
from services.api.socket_driver import SocketEndpoint
from services.api.worker_client import WorkerClient
from shared.contracts import SessionRuntimeConfig
from shared.ids import key_digest
from shared.loop_lag import LoopLagMonitor
from shared.redis.connection import RedisHandle
from shared.redis.keys import KeySchema
from shared.redis.placement import WorkerDirectory
from shared.redis.store import SessionStore
from shared.settings import ApiSettings

log = logging.getLogger(__name__)


class ApiPod:
    def __init__(
        self, settings: ApiSettings, redis: RedisHandle, runtime: SessionRuntimeConfig | None = None
    ):
        self.settings = settings
        self.redis = redis
        self.client = redis.client
        self.keys = KeySchema(settings.key_prefix)
        self.store = SessionStore(
            self.client,
            self.keys,
            # an embedded fakeredis has no replica (nor WAIT)
            replica_acks=settings.redis_replica_acks if redis.server is None else 0,
            replica_ack_timeout_ms=settings.redis_replica_ack_timeout_ms,
        )
        self.runtime = runtime or settings.session  # the policy the workers apply too
        self.metrics = ApiMetrics()
        self.authorized = KeyChecker(settings.api_keys)
        self.directory = WorkerDirectory(
            self.client, self.keys, settings.heartbeat_ttl_s, settings.placement_epsilon
        )
        self.hub = LiveHub(redis.pubsub_client(), self.keys.api(settings.pod_id))
        self.inbox_writer = InboxWriter(
            self.client,
            self.keys,
            self.store.scripts,
            linger_s=settings.append_linger_ms / 1000,
        )
        self.workers = WorkerClient(self.inbox_writer)
        self.liveness = PodLiveness(
            self.client,
            self.keys,
            self.store,
            settings.pod_id,
            settings.heartbeat_interval_s,
            settings.heartbeat_ttl_s,
        )
        self.janitor = Janitor(
            redis,
            self.keys,
            self.store,
            self.workers,
            self.runtime,
            heartbeat_ttl_s=settings.heartbeat_ttl_s,
            disconnect_grace_s=self.runtime.disconnect_grace_s,
            directory=self.directory,
            live=self.hub,
            steady=self.liveness.steady,
        )
        self.loop_lag = LoopLagMonitor(
            f"API pod {settings.pod_id}", self.metrics.loop_lag, settings.loop_lag_warn_s
        )
        #: every WebSocket route's key and Origin check (services/api/door.py)
        self.door = Door(self.authorized, settings.allowed_origins)
        self.realtime = RealtimeEndpoint(self.door, self.metrics, self.connection)
        self.moshi_chat = MoshiChatEndpoint(
            self.door,
            self.metrics,
            self.session_parts,
            admission_wait_s=settings.admission_wait_s,
            handshake_timeout_s=settings.model_ready_timeout_s,
        )
        self.live_sessions = LiveSessionsEndpoint(
            self.door,
            self.metrics,
            self.session_parts,
            config_timeout_s=settings.config_timeout_s,
            ready_timeout_s=settings.model_ready_timeout_s,
            max_input_bytes=self.runtime.max_pending_input_bytes_per_session,
        )
        self.map_realtime = MapRealtimeEndpoint(
            self.door,
            self.metrics,
            self.session_parts,
            self.directory,
            admission_wait_s=settings.admission_wait_s,
            config_timeout_s=settings.config_timeout_s,
            ready_timeout_s=settings.model_ready_timeout_s,
            max_input_bytes=self.runtime.max_pending_input_bytes_per_session,
        )
        #: every protocol's WebSocket route: a protocol added to the pod is one more here
        #: (MAP Realtime before OpenAI's Realtime: it shares the path, named by its subprotocol)
        self.socket_endpoints: tuple[SocketEndpoint, ...] = (
            self.map_realtime,
            self.realtime,
            self.moshi_chat,
            self.live_sessions,
        )
        # chat requests go through WorkerClient too, so they count against the inbox budget
        self.chat = ChatCompletions(
            self.client,
            self.keys,
            self.directory,
            settings.chat_max_body_bytes,
            settings.chat_timeout_s,
            self.workers,
        )
        self._ready_detail: str | None = None  # the last failure ready() logged

    # ------------------------------------------------------------ per socket

    def connection(
        self,
        websocket: WebSocket,
        *,
        model: str | None,
        autostart: bool,
        resume_only: bool,
        api_key: str | None = None,
    ) -> RealtimeConnection:
        """The connection of one accepted socket, with its attachment and delivery."""
        parts = self.session_parts(api_key)
        return RealtimeConnection(
            websocket,
            parts.attachment,
            parts.delivery,
            parts.view,
            self.metrics,
            model=model,
            autostart=autostart,
            resume_only=resume_only,
            config_timeout_s=self.settings.config_timeout_s,
            max_input_bytes=self.runtime.max_pending_input_bytes_per_session,
        )

    def session_parts(self, api_key: str | None) -> SessionParts:
        """What any surface's socket holds its session with: its attachment (the hold), its
        delivery (the events out, through a bounded queue) and the session's view."""
        settings, runtime = self.settings, self.runtime
        feed = LiveFeed()
        attachment = Attachment(
            feed=feed,
            hub=self.hub,
            store=self.store,
            client=self.client,
            keys=self.keys,
            directory=self.directory,
            workers=self.workers,
            liveness=self.liveness,
            pod_id=settings.pod_id,
            open_timeout_s=settings.open_timeout_s,
            disconnect_grace_s=self.runtime.disconnect_grace_s,
            # the session is bound to the key that opened it: only that key may resume it
            key_sha=key_digest(api_key) if settings.api_keys and api_key else "",
        )
        queue = OutputQueue(
            runtime.max_pending_output_bytes_per_session,
            runtime.max_pending_output_events_per_session,
            runtime.output_reserve_bytes,
            runtime.output_reserve_events,
        )
        view = SessionView()
        delivery = Delivery(attachment, feed, queue, self.store, self.metrics, view)
        return SessionParts(attachment, delivery, view)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.store.scripts.ensure_loaded(self.client)
        await self.hub.start()
        await self.liveness.start()
        await self.janitor.start()
        self.loop_lag.start()

    async def stop(self) -> None:
        await self.loop_lag.stop()
        await self.janitor.stop()
        await self.liveness.stop()
        await self.hub.stop()
        await self.workers.stop()
        self.moshi_chat.close()
        with contextlib.suppress(Exception):
            await self.client.zrem(self.keys.apis(), self.settings.pod_id)

    async def ready(self) -> tuple[bool, str]:
        """(ready, reason) for GET /health/ready. The reason is public (probes carry no
        key): it never names the Redis host, port or error; the log does, once a change."""
        try:
            await self.client.ping()
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            if detail != self._ready_detail:
                log.warning("not ready: Redis unreachable (%s)", detail)
                self._ready_detail = detail
            return False, "redis unreachable"
        self._ready_detail = None
        if not self.hub.connected.is_set():
            return False, "live event channel reconnecting"
        if not await self.directory.live_workers():
            return False, "no live worker"
        return True, "ok"

    async def models(self) -> list[str]:
        """The models the live workers serve (GET /v1/models)."""
        return await self.directory.models()
