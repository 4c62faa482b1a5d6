"""One socket's hold on one session: open (the placement walk), resume, takeover, release.

An attachment is the API pod's only session state, and it outlives nothing: the session
lives on its worker, its lease and journal in Redis. It keeps the session id, its worker,
its attachment generation (the fence of every lease script) and its command seq, and one
`AttachmentState` (services/api/attachment_state.py: the table of its transitions).

Its worker can change: a drain or a failover moves the session under a newer owner
generation and says so on the live channel (`!moved <owner generation> <worker>`, `moved`);
after a hub reconnect (`CATCH_UP`) and at a resume the session hash says where it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from typing import Any

import orjson
from redis.exceptions import RedisError

from services.api.attachment_state import (
    LIVE,
    SETTLED,
    TRANSITIONS,
    AttachmentState,
    AttachmentStateError,
    S,
)
from services.api.command_sender import CommandSender
from services.api.live import CATCH_UP, LiveFeed, LiveHub
from services.api.liveness import PodLiveness
from services.api.worker_client import WorkerClient
from shared.ids import new_session_id
from shared.protocol.duplex import (
    NATIVE_SURFACES,
    SURFACE_DUPLEX,
    DuplexCommand,
    DuplexErrorEvent,
    DuplexEvent,
    DuplexSessionCreated,
    Heartbeat,
    SessionResume,
    SessionResyncRequired,
)
from shared.redis.boundary import ControlNotice
from shared.redis.keys import KeySchema
from shared.redis.live_message import is_control
from shared.redis.placement import WorkerDirectory
from shared.redis.store import ResumeResync, SessionStore, SessionStoreError, token_digest

log = logging.getLogger(__name__)

#: the capability a native (frame-clocked) model's workers register (FrameClockedPlugin)
NATIVE_CAPABILITY = "supports_model_native_turn_policy"


class AttachFailed(Exception):
    """Nothing is held. `event` tells the client why, or `reply` is the worker's refusal."""

    def __init__(
        self, event: DuplexEvent | None = None, reply: dict[str, Any] | None = None
    ) -> None:
        super().__init__(event.wire_type if event is not None else "worker refused the open")
        self.event = event
        self.reply = reply


@dataclasses.dataclass(frozen=True)
class Resumed:
    session: dict[str, Any]  # the session object the worker last stored
    resume_token: str  # the rotated token (only its SHA-256 is stored)


def error(code: str, message: str, event_id: str | None = None, **extra: Any) -> DuplexErrorEvent:
    return DuplexErrorEvent.for_code(code, message, related_event_id=event_id, **extra)


class Attachment:
    def __init__(
        self,
        *,
        feed: LiveFeed,
        hub: LiveHub,
        store: SessionStore,
        client: Any,
        keys: KeySchema,
        directory: WorkerDirectory,
        workers: WorkerClient,
        liveness: PodLiveness,
        pod_id: str,
        open_timeout_s: float,
        disconnect_grace_s: float,
        key_sha: str = "",
    ) -> None:
        self._feed = feed
        self._hub = hub
        self._store = store
        self._client = client
        self._keys = keys
        self._directory = directory
        self._workers = workers
        self._liveness = liveness
        self._pod_id = pod_id
        self.open_timeout_s = open_timeout_s
        self._grace_ms = int(disconnect_grace_s * 1000)
        self.key_sha = key_sha  # the session is bound to the key that opened it
        self.state = S.NEW
        self.session_id: str | None = None
        self.worker_id: str | None = None
        self.owner_generation = 0  # the placement `worker_id` belongs to (owner_move.lua)
        self.generation = 0
        self.resumable = False
        self.commands = CommandSender(workers, feed)  # the seqs; appends not awaited
        #: the duplex surface: a resumable session, and its open's reply says which worker
        #: took it. The others (OpenAI GA's, Moshi's, GPT-Live's) have neither
        self.duplex = True
        #: only a native (frame-clocked) model's workers may take the session: Moshi's and
        #: GPT-Live's surfaces, whose sessions only those models serve
        self.native_only = False

    def serve_surface(self, surface: str) -> None:
        """The session is opened on `surface` (before `open`): what it may be (resumable,
        which workers may take it) follows from it."""
        self.duplex = surface == SURFACE_DUPLEX
        self.native_only = surface in NATIVE_SURFACES

    def _move(self, to: AttachmentState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise AttachmentStateError(f"attachment of {self.session_id}: {self.state} -> {to}")
        self.state = to

    @property
    def live(self) -> bool:  # the client's commands go to the worker
        return self.state in LIVE

    # ------------------------------------------------------------ open

    async def open(self, session: dict[str, Any], default_model: str | None) -> dict[str, Any]:
        """Place a new session on the first worker that admits it; returns the
        session.created to deliver. Raises `AttachFailed`."""
        requested = session.get("model")
        if requested is not None and (not isinstance(requested, str) or not requested.strip()):
            # `model: []` (or 0, or "") must not silently open the default model
            raise AttachFailed(
                error(
                    "invalid_session_config",
                    "session.model must be a model name (a non-empty string)",
                    param="session.model",
                )
            )
        model = requested or default_model
        session_id = new_session_id()
        candidates = await self._directory.candidates(model, session_id)
        if self.native_only:
            candidates = [w for w in candidates if w.capabilities.get(NATIVE_CAPABILITY)]
            if not candidates:
                raise AttachFailed(await self._no_native_worker(model))
        if not candidates:
            raise AttachFailed(await self._no_worker(model))
        self._move(S.PLACING)
        token = secrets.token_urlsafe(32)
        await self._hub.subscribe(self._keys.live(session_id), self._feed.push)
        self.session_id = session_id
        # indexed under this pod before the client can know the session: should the pod
        # die right after, the dead-pod sweep finds it (it checks the hash's `pod` field)
        await self._client.sadd(self._keys.api_sessions(self._pod_id), session_id)
        for worker in candidates:
            resumable = self.duplex and bool(worker.capabilities.get("supports_session_resume"))
            payload = {**session, "model": worker.model}
            await self._store.open(
                session_id,
                worker.worker_id,
                worker.model,
                token_digest(token) if resumable else "",
                orjson.dumps(payload).decode(),
                self._pod_id,
                self.key_sha,
            )
            self.worker_id = worker.worker_id
            self._move(S.OPENING)
            await self._workers.open(worker.worker_id, session_id, payload)
            reply = await self.first_reply()
            if reply is not None and reply.get("type") == "session.created":
                self.generation, self.owner_generation, self.resumable = 1, 1, resumable
                self._move(S.OPENED)
                self._liveness.attach(session_id, 1)
                if resumable:
                    reply.update(resume_token=token, attachment_generation=1)
                if self.duplex:
                    reply["duplex_worker_id"] = worker.worker_id  # for consoles and debugging
                return reply
            await self._client.delete(self._keys.session(session_id), self._keys.events(session_id))
            code = (reply or {}).get("error", {}).get("code") if reply else None
            if code == "resource_exhausted":
                self.worker_id = None
                self._move(S.PLACING)
                continue  # a race with another pod: walk on to the next worker
            await self._abandon()
            if reply is None:
                raise AttachFailed(
                    error("timeout", "the worker did not answer the open in time", retryable=True)
                )
            raise AttachFailed(reply=reply)
        await self._abandon()
        raise AttachFailed(
            error("resource_exhausted", "every worker of this model is full", retryable=True)
        )

    async def _no_native_worker(self, model: str | None) -> DuplexErrorEvent:
        """Why no native model's worker can take a session of Moshi's or GPT-Live's
        surface: they are all full, or the model is not one."""
        workers = [
            w for w in await self._directory.live_workers() if model is None or w.model == model
        ]
        if any(w.capabilities.get(NATIVE_CAPABILITY) for w in workers):
            return error(
                "resource_exhausted",
                "duplex_session_capacity_exhausted: every worker of this model is full",
                retryable=True,
            )
        if not workers:
            return await self._no_worker(model)
        if model is None:
            # other models' workers are live, a native one is not (yet: starting, restarting)
            return error(
                "resource_exhausted",
                "no worker of a native full-duplex (frame-clocked) model is live",
                retryable=True,
            )
        return error(
            "invalid_session_config",
            f"model {model!r} is not a native full-duplex (frame-clocked) one: this protocol "
            "serves those only",
            param="model",
        )

    async def _no_worker(self, model: str | None) -> DuplexErrorEvent:
        served = await self._directory.models()
        if model and served and model not in served:
            return error("invalid_session_config", f"model {model!r} is not served; try {served}")
        if model in served or (not model and served):
            return error(
                "resource_exhausted",
                "duplex_session_capacity_exhausted: every worker of this model is full",
                retryable=True,
            )
        return error("resource_exhausted", "no live worker serves this model", retryable=True)

    async def _abandon(self) -> None:
        session_id, self.session_id, self.worker_id = self.session_id, None, None
        self._move(S.RELEASED)
        if session_id is None:
            return
        await self._hub.unsubscribe(self._keys.live(session_id), self._feed.push)
        await self._client.srem(self._keys.api_sessions(self._pod_id), session_id)

    async def first_reply(self) -> dict[str, Any] | None:
        """The worker's answer to an open: session.created or an error (control notices skipped).

        session.created is not journaled: if its live message was missed (the pub/sub
        connection was reconnecting, which the hub announces with CATCH_UP), the session
        hash, which the same script marked active with the session object, stands in for
        it. The hash is read then, and once more when the open timeout runs out."""
        try:
            async with asyncio.timeout(self.open_timeout_s):
                while True:
                    data = await self._feed.get()
                    if data == CATCH_UP:
                        if (created := await self._created_from_hash()) is not None:
                            return created
                    elif not is_control(data):  # the open's reply, not a notice
                        return orjson.loads(data)
        except TimeoutError:
            return await self._created_from_hash()

    async def _created_from_hash(self) -> dict[str, Any] | None:
        if self.session_id is None:
            return None
        meta = await self._store.meta(self.session_id)
        if meta.get("state") == "active" and meta.get("session"):
            return DuplexSessionCreated(session=orjson.loads(meta["session"])).to_dict()
        return None

    # ------------------------------------------------------------ resume

    async def resume(self, request: SessionResume) -> Resumed:
        """Take the session over with its resume token (lease CAS); raises `AttachFailed`.
        Once this returns, the old socket (wherever it is) has been told to go."""
        sid = request.session_id
        self._move(S.RESUMING)
        self.session_id = sid
        # first: nothing published after the CAS is missed
        await self._hub.subscribe(self._keys.live(sid), self._feed.push)
        new_token = secrets.token_urlsafe(32)
        try:
            result = await self._store.resume(
                sid,
                request.resume_token,
                new_token,
                request.last_received_server_event_seq,
                self._pod_id,
                self.key_sha,
            )
        except SessionStoreError as exc:
            await self._give_up(sid)
            raise AttachFailed(
                error(exc.code, f"cannot resume {sid}: {exc.code}", request.event_id)
            ) from None
        except RedisError as exc:
            # the session store is away (a failover): nothing was taken over; the client
            # tries again (retryable), as it would after a dropped socket
            with contextlib.suppress(RedisError):
                await self._give_up(sid)
            raise AttachFailed(
                error(
                    "internal_error",
                    f"cannot resume {sid} now: the session store is unreachable ({exc}); retry",
                    request.event_id,
                    retryable=True,
                )
            ) from None
        if isinstance(result, ResumeResync):
            await self._give_up(sid)
            raise AttachFailed(SessionResyncRequired(session_id=sid, reason=result.reason))
        self.generation, self.resumable = result.attachment_generation, True
        # the owner as the hash has it now (the feed, subscribed first, has any later move)
        worker_id, self.owner_generation = await self._read_owner(sid)
        self.worker_id = worker_id or result.worker_id
        self._move(S.ATTACHED)
        self._liveness.attach(sid, self.generation)
        await self._client.sadd(self._keys.api_sessions(self._pod_id), sid)
        notice = ControlNotice.takeover(self.generation).to_bytes()
        await self._hub.publish(self._keys.live(sid), notice)
        session = orjson.loads(result.session) if result.session else {}
        return Resumed(session, new_token)

    async def _give_up(self, session_id: str) -> None:
        self.session_id = None
        self._move(S.RELEASED)
        await self._hub.unsubscribe(self._keys.live(session_id), self._feed.push)

    # ------------------------------------------------------------ attached

    def created_delivered(self) -> None:
        """The writer put session.created on the wire: a socket that goes now detaches
        (or closes) the session instead of abandoning a session its client never knew."""
        if self.state is S.OPENED:
            self._move(S.ATTACHED)
        elif self.state not in (S.ATTACHED, *SETTLED):
            raise AttachmentStateError(f"session.created sent while {self.state}")

    def end(self) -> None:
        """The session's closure (session.closed / session.expired) is queued."""
        if self.state not in SETTLED:
            self._move(S.ENDED)

    def taken_over(self, generation: int) -> bool:
        """A takeover notice: True (and REPLACED) when its generation is newer than ours."""
        if generation <= self.generation:
            return False
        self._move(S.REPLACED)
        return True

    def moved(self, owner_generation: int, worker_id: str) -> bool:
        """The session's owner is now `worker_id` (a `moved` notice, or the hash): True
        (and its commands go there from now) when `owner_generation` is newer than ours."""
        if owner_generation <= self.owner_generation or not worker_id or self.state is S.RELEASED:
            return False
        log.info("session %s moved: commands to worker %s now", self.session_id, worker_id)
        self.worker_id, self.owner_generation = worker_id, owner_generation
        return True

    async def reread_owner(self) -> bool:
        """After `CATCH_UP` (a `moved` notice may be lost): adopt the hash's owner if newer."""
        if self.session_id is None or self.state is S.RELEASED:
            return False
        worker_id, owner_generation = await self._read_owner(self.session_id)
        return worker_id is not None and self.moved(owner_generation, worker_id)

    async def gone(self, unknown: bool) -> bool:
        """Whether the session's hash is gone from Redis (a failover, or a Redis that
        restarted empty, can lose it under a live socket); `unknown` when Redis does not
        answer (the delivery pump that asks must not die of it: its client would wait)."""
        if self.session_id is None:
            return False
        try:
            return not await self._client.exists(self._keys.session(self.session_id))
        except RedisError:
            log.warning("session %s: reading whether its hash is there failed", self.session_id)
            return unknown

    async def _read_owner(self, session_id: str) -> tuple[str | None, int]:
        """(worker, owner generation) from the session hash; (None, 0) when it is gone."""
        worker, generation = await self._client.hmget(
            self._keys.session(session_id), "worker", "owner_generation"
        )
        if worker is None:
            return None, 0
        return worker.decode(), int(generation or 1)

    def _held(self) -> tuple[str, str]:
        if self.session_id is None or self.worker_id is None:
            raise AttachmentStateError(f"no session is held ({self.state})")
        return self.session_id, self.worker_id

    @property
    def command_seq(self) -> int:  # the last handed out (a refused entry gives its seqs back)
        return self.commands.seqs.last

    async def command(self, command: DuplexCommand) -> None:
        """A client command to the worker. An append returns once queued (`CommandSender`);
        any other raises `InboxFull` when the inbox's budget refused it, or Redis' error."""
        sid, worker_id = self._held()
        written = await self.commands.send(worker_id, sid, self.generation, command)
        if written is None:
            return
        if isinstance(command, Heartbeat):
            # the lease refresh and the command travel at once: awaiting the touch first
            # put a whole Redis round trip in front of every heartbeat_ack
            await asyncio.gather(self._store.touch(sid, self.generation, self._pod_id), written)
        else:
            await written

    async def acknowledge(self, seq: int) -> bool:
        """The client has the events up to `seq`; False when `seq` is past the newest."""
        sid, _ = self._held()
        return await self._store.ack(sid, seq) != -1

    async def touch(self) -> None:
        """Tell the worker a socket holds the session again (after a resume)."""
        sid, worker_id = self._held()
        await self._workers.touch(worker_id, sid, self.generation)

    async def close(self, reason: str) -> None:
        """Ask the worker to close the session (the pod's decision: output overflow)."""
        sid, worker_id = self._held()
        await self._workers.close(worker_id, sid, self.generation, reason)

    # ------------------------------------------------------------ release

    async def release(self) -> None:
        """The socket is gone. A session taken over or ended is left as it is; one whose
        session.created never reached its client is closed; a resumable one is detached
        (fenced on our generation: a newer attachment wins); any other is closed."""
        sid = self.session_id
        if sid is None:  # never opened, or a failed open or resume let go already
            if self.state is not S.RELEASED:
                self._move(S.RELEASED)
            return
        held = self.state is not S.RESUMING  # a resume short of the lease holds nothing
        self._liveness.release(sid, self.generation)
        with contextlib.suppress(Exception):
            await self._hub.unsubscribe(self._keys.live(sid), self._feed.push)
            if held:
                await self._client.srem(self._keys.api_sessions(self._pod_id), sid)
        state = self.state  # read after the awaits: the writer may have sent session.created
        if state not in (S.OPENING, *LIVE) or self.worker_id is None:
            return self._move(S.RELEASED)
        self._move(S.DETACHING)
        try:
            if state is not S.ATTACHED:  # the client never had session.created
                await self._workers.close(
                    self.worker_id, sid, self.generation, "session_created_undelivered"
                )
            elif self.resumable:
                await self._store.detach(sid, self.generation, self._grace_ms)
            else:
                await self._workers.close(self.worker_id, sid, self.generation, "disconnect")
        except Exception:
            log.exception("releasing session %s failed", sid)
        finally:
            self._move(S.RELEASED)
