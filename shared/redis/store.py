"""Typed wrappers over the session scripts and reads (one method per Redis operation)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster

from shared.errors import CodedError
from shared.ids import now_ms, token_digest
from shared.outage_log import OutageLog
from shared.redis.boundary import InboxMessage, encode_entry, entry_bytes
from shared.redis.inbox_stripes import StripeDirectory
from shared.redis.keys import INBOX_GROUP, KeySchema
from shared.redis.live_message import (
    LiveRecord,
    header_token,
    journal_entry_records,
    response_token,
)
from shared.redis.scripts import LuaScript, Scripts

log = logging.getLogger(__name__)


def _notice_event_id() -> str:
    """The event id of a session.resync_required notice, should the journal overflow.
    Imported on the first publish, not with this module: the readers of Redis
    (`duplex sessions`, `duplex workers`) use the store and must not load the wire
    codec and numpy with it."""
    from shared.protocol.duplex import new_event_id

    return new_event_id()


INBOX_ACK_BATCH = 1000  # entries per inbox_ack.lua call
TOUCH_REACTIVATED = 2  # lease_touch.lua: a detached session taken back by its attachment


class SessionStoreError(CodedError):
    """A script refused: `code` is the contract error code."""


class PartialPublish(Exception):
    """Some calls of a `publish_many` on a cluster failed (their master is away); the
    others were written: their replies are in `written`, and must not be sent again."""

    def __init__(self, written: dict[str, list[int]], failed: dict[str, BaseException]):
        first = next(iter(failed.values()))
        super().__init__(f"{len(failed)} of {len(written) + len(failed)} sessions: {first}")
        self.written = written
        self.failed = failed


@dataclasses.dataclass(frozen=True)
class PublishItem:
    """One event to publish: its JSON, type, whether it is journaled, the session object it
    carries (created/updated), its response's id (for the live header)."""

    data: bytes
    wire_type: str
    journaled: bool = True
    session_json: bytes = b""
    response_id: str | None = None


@dataclasses.dataclass(frozen=True)
class ModelAppend:
    """What a publish call appends to a model-native session's model history: `data` at
    byte `offset`, whole records in the history's layout; `record_bytes` is the meta hash's
    `model_record_bytes` (a fixed record's size, 0 for sized records: each after its 4-byte
    length, shared/contracts/model_history.py)."""

    offset: int
    data: bytes
    record_bytes: int


@dataclasses.dataclass(frozen=True)
class SessionWrite:
    """One session's part of a publish call: its events, the owner generation the call is
    fenced on (None: not fenced), the checkpoint stored after them (b"": none), whether its
    JSON carries `server_event_seq` (`stamp_seq`: False on the openai surface), and what it
    appends to the model history."""

    session_id: str
    items: Sequence[PublishItem]
    owner_generation: int | None = None
    checkpoint: bytes = b""
    stamp_seq: bool = True
    model_append: ModelAppend | None = None
    #: the highest seq the writer knows was journaled (0: none known): a store found below
    #: it went back in time, and is moved forward past it before any seq is handed out
    seq_floor: int = 0
    #: the writing worker's id (""): with owner_generation, a store found to have lost
    #: the move that made it the owner is set back to it (event_publish.lua)
    worker_id: str = ""
    #: the round's token (""): a call sent again under the token of the session's last
    #: written call is answered with that call's reply, and nothing is written twice
    round_token: str = ""


@dataclasses.dataclass(frozen=True)
class ResumeGranted:
    attachment_generation: int
    lease_generation: int
    worker_id: str
    next_seq: int
    session: bytes
    model: str


@dataclasses.dataclass(frozen=True)
class ResumeResync:
    reason: str  # journal_gap | journal_overflow


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclasses.dataclass(frozen=True)
class RestoreState:
    """What a worker restores a moved session from (`SessionStore.restore_state`)."""

    checkpoint: bytes | None
    #: the model history (b"" when none)
    model_history: bytes
    #: the bytes of one record as the history's writer gave them (`model_record_bytes`);
    #: None when nothing was written: a model of another record size cannot replay it
    model_record_bytes: int | None
    #: the journal's last seq: the new owner's seq floor (a store that goes back in time
    #: under it, before its first write, never hands out a seq a client may have)
    next_seq: int = 0


class SessionStore:
    def __init__(
        self,
        client: Any,
        keys: KeySchema | None = None,
        scripts: Scripts | None = None,
        *,
        replica_acks: int = 0,
        replica_ack_timeout_ms: int = 500,
    ) -> None:
        self.client = client
        self.keys = keys or KeySchema()
        self.scripts = scripts or Scripts()
        #: the writes a failover must not lose (a resume's token rotation, an owner move)
        #: wait for this many replicas to acknowledge them (WAIT), at most the timeout; 0:
        #: not waited (one Redis, or a cluster: WAIT covers its own connection's writes, and
        #: a cluster client does not pipeline scripts)
        self.replica_acks = 0 if isinstance(client, RedisCluster) else replica_acks
        self.replica_ack_timeout_ms = replica_ack_timeout_ms
        self.unacked = 0  # such writes a replica had not acknowledged in time
        self._unacked_log = OutageLog(log, "replicas acknowledging the writes a failover must keep")
        #: the workers' inbox stripes, for the entries this process writes to a session's
        self.stripes = StripeDirectory(client, self.keys)

    async def _acknowledged(self, script: LuaScript, keys: list[str], args: list[Any]) -> Any:
        """The script's reply; with `replica_acks`, once that many replicas have the write
        (a WAIT sent after it on the same connection, which is what WAIT counts) or the
        timeout passed: then the write stands unacknowledged, counted and logged once per
        run, since a failover now could still lose it."""
        if not self.replica_acks:
            return await script(self.client, keys, args)
        for attempt in range(2):
            pipeline = self.client.pipeline(transaction=False)
            script.queue(pipeline, keys, args)
            pipeline.execute_command("WAIT", self.replica_acks, self.replica_ack_timeout_ms)
            # errors as replies: the script's own (a refusal) is raised as it would be alone
            reply, acked = await pipeline.execute(raise_on_error=False)
            if isinstance(reply, redis_errors.NoScriptError) and not attempt:
                await script.ensure_loaded(self.client)
                continue
            if isinstance(reply, Exception):
                raise reply
            if isinstance(acked, Exception):
                raise acked
            if int(acked) < self.replica_acks:
                self.unacked += 1
                self._unacked_log.failed(
                    TimeoutError(
                        f"{acked} of {self.replica_acks} replicas acknowledged within "
                        f"{self.replica_ack_timeout_ms} ms"
                    ),
                    traceback=False,
                )
            else:
                self._unacked_log.succeeded()
            return reply
        raise AssertionError("unreachable")

    def _session_keys(self, session_id: str) -> list[str]:
        return [
            self.keys.session(session_id),
            self.keys.events(session_id),
            self.keys.checkpoint(session_id),
            self.keys.model_history(session_id),
        ]

    async def open(
        self,
        session_id: str,
        worker_id: str,
        model: str,
        token_sha: str,
        config_json: str,
        pod_id: str = "",
        key_sha: str = "",
    ) -> None:
        try:
            args = [worker_id, model, token_sha, now_ms(), config_json, pod_id, key_sha]
            await self.scripts.session_open(self.client, self._session_keys(session_id), args)
        except redis_errors.ResponseError as exc:
            raise SessionStoreError(str(exc).split()[0], str(exc)) from None

    def _publish_call(
        self, write: SessionWrite, max_bytes: int, ttl_ms: int, closed_ttl_ms: int
    ) -> tuple[list[str], list[Any]]:
        session_id, items, model_append = write.session_id, write.items, write.model_append
        owner_generation, stamp_seq = write.owner_generation, write.stamp_seq
        args: list[Any] = [
            self.keys.live(session_id),
            max_bytes,
            ttl_ms,
            now_ms(),
            closed_ttl_ms,
            _notice_event_id(),
            "" if owner_generation is None else owner_generation,
            write.checkpoint,
            "1" if stamp_seq else "0",
            # on a cluster the live channel (same hash tag) is a shard channel: SPUBLISH
            "1" if isinstance(self.client, RedisCluster) else "0",
            "" if model_append is None else model_append.offset,
            b"" if model_append is None else model_append.data,
            "" if model_append is None else model_append.record_bytes,
            write.seq_floor,
            write.worker_id,
            write.round_token,
        ]
        for item in items:
            journaled, rid = "1" if item.journaled else "0", response_token(item.response_id)
            wire_type = header_token(item.wire_type, "event type")
            args += [journaled, wire_type, item.data, item.session_json, rid]
        return self._session_keys(session_id), args

    async def publish(
        self,
        session_id: str,
        items: Sequence[PublishItem],
        *,
        max_bytes: int,
        ttl_ms: int,
        closed_ttl_ms: int,
        owner_generation: int | None = None,
        checkpoint: bytes = b"",
        stamp_seq: bool = True,
    ) -> list[int]:
        """Publish one session's events in one round trip and one live message; returns
        their seqs (0 = unjournaled), [-1] when the session is gone, [-2] when
        `owner_generation` is not the session's (nothing was written). With a checkpoint, it
        is stored after the events. `stamp_seq` False (the openai surface): no
        `server_event_seq` in the JSON, only in the live header and the entry id."""
        write = SessionWrite(session_id, items, owner_generation, checkpoint, stamp_seq)
        keys, args = self._publish_call(write, max_bytes, ttl_ms, closed_ttl_ms)
        return [int(seq) for seq in await self.scripts.event_publish(self.client, keys, args)]

    async def publish_many(
        self,
        writes: Sequence[SessionWrite],
        *,
        max_bytes: int,
        ttl_ms: int,
        closed_ttl_ms: int,
    ) -> dict[str, list[int]]:
        """Publish several sessions' writes (one each): one pipelined round trip on one
        Redis; on a cluster (which refuses scripts in pipelines) concurrent calls, one per
        session. Returns each session's reply (see `publish`)."""
        sessions = [write.session_id for write in writes]
        if len(set(sessions)) != len(sessions):
            raise ValueError("publish_many takes one write per session")
        calls = [self._publish_call(write, max_bytes, ttl_ms, closed_ttl_ms) for write in writes]
        script = self.scripts.event_publish
        if isinstance(self.client, RedisCluster):
            # each call settles on its own: a master that is failing over fails its sessions'
            # calls, never those the other masters wrote (sent again, they would be journaled
            # twice under new seqs)
            replies = await asyncio.gather(
                *(script(self.client, keys, args) for keys, args in calls),
                return_exceptions=True,
            )
            written = {
                sid: [int(v) for v in reply]
                for sid, reply in zip(sessions, replies, strict=True)
                if not isinstance(reply, BaseException)
            }
            failed = {
                sid: reply
                for sid, reply in zip(sessions, replies, strict=True)
                if isinstance(reply, BaseException)
            }
            if failed:
                raise PartialPublish(written, failed)
            return written
        for attempt in range(2):
            pipeline = self.client.pipeline(transaction=False)
            for keys, args in calls:
                script.queue(pipeline, keys, args)
            try:
                replies = await pipeline.execute()
                return {
                    sid: [int(v) for v in reply]
                    for sid, reply in zip(sessions, replies, strict=True)
                }
            except redis_errors.NoScriptError:
                if attempt:
                    raise
                # nothing ran (every call is the same missing script): load it, send again
                await script.ensure_loaded(self.client)
        raise AssertionError("unreachable")

    async def move_owner(
        self,
        session_id: str,
        from_worker: str,
        to_worker: str,
        why: str,
        expected_generation: int | None = None,
        paused_at_ms: int | None = None,
    ) -> int:
        """Hand the session from one worker to another (owner_move.lua): the new owner
        generation, or 0 when it was not on `from_worker` (at `expected_generation`).
        `paused_at_ms`: when the old owner stopped serving it (a drain), kept in the hash
        beside the `restored_at` the new owner writes (`mark_restored`)."""
        args: list[Any] = [
            from_worker,
            "" if expected_generation is None else expected_generation,
            to_worker,
            now_ms(),
            why,
            "" if paused_at_ms is None else paused_at_ms,
        ]
        keys = [self.keys.session(session_id)]
        return int(await self._acknowledged(self.scripts.owner_move, keys, args))

    async def mark_restored(self, session_id: str) -> None:
        """The new owner serves the session from now: `restored_at` (ms) in its hash."""
        await self.client.hset(self.keys.session(session_id), "restored_at", now_ms())

    async def write_restore_progress(
        self, progress: Sequence[tuple[str, int, bytes]]
    ) -> list[bool]:
        """Each (session, owner generation, progress JSON) into the session's hash
        (`restore`), in one round trip (restore_progress.lua: only while that generation
        owns it); whether each was written."""
        if not progress:
            return []
        script = self.scripts.restore_progress
        if isinstance(self.client, RedisCluster):  # no scripts in a cluster's pipelines
            replies = await asyncio.gather(
                *(
                    script(self.client, [self.keys.session(sid)], [generation, data])
                    for sid, generation, data in progress
                )
            )
            return [bool(written) for written in replies]
        for attempt in (1, 2):
            pipeline = self.client.pipeline(transaction=False)
            for session_id, generation, data in progress:
                script.queue(pipeline, [self.keys.session(session_id)], [generation, data])
            try:
                return [bool(written) for written in await pipeline.execute()]
            except redis_errors.NoScriptError:
                if attempt == 2:
                    raise
                await script.ensure_loaded(self.client)  # a Redis that restarted or failed over
        raise AssertionError("unreachable")

    async def checkpoint(self, session_id: str) -> bytes | None:
        """The session's last checkpoint (JSON), or None."""
        return await self.client.get(self.keys.checkpoint(session_id))

    async def restore_state(self, session_id: str) -> RestoreState:
        """The session's last checkpoint, its model history (b"" when none) and the size
        of the history's records as its writer gave them, read at once (one round trip:
        the keys share the session's hash tag)."""
        pipeline = self.client.pipeline(transaction=False)
        pipeline.get(self.keys.checkpoint(session_id))
        pipeline.get(self.keys.model_history(session_id))
        pipeline.hmget(self.keys.session(session_id), "model_record_bytes", "next_seq")
        checkpoint, history, (record_bytes, next_seq) = await pipeline.execute()
        return RestoreState(
            checkpoint,
            history or b"",
            int(record_bytes) if record_bytes else None,
            int(next_seq or 0),
        )

    async def detach(
        self, session_id: str, attachment_generation: int, grace_ms: int, by: str = "client"
    ) -> int:
        """1 detached; 0 a newer attachment holds it; -1 unknown; -2 closed. `by` is
        "client" (its socket closed) or "sweep" (its pod was declared dead: the pod may
        take it back, `touch`)."""
        args = [attachment_generation, now_ms(), grace_ms, by]
        deadline = int(
            await self.scripts.lease_detach(self.client, [self.keys.session(session_id)], args)
        )
        if deadline <= 0:
            return deadline
        # the index of due leases lives in another slot: written after the script
        await self.client.zadd(self.keys.leases(), {session_id: deadline})
        return 1

    async def resume(
        self,
        session_id: str,
        token: str,
        new_token: str,
        last_seq: int,
        pod_id: str = "",
        key_sha: str = "",
    ) -> ResumeGranted | ResumeResync:
        keys = self._session_keys(session_id)
        args = [
            session_id,
            token_digest(token),
            token_digest(new_token),
            last_seq,
            now_ms(),
            pod_id,
            key_sha,
        ]
        try:
            reply = await self._acknowledged(self.scripts.lease_resume, keys, args)
        except redis_errors.ResponseError as exc:
            raise SessionStoreError(str(exc).split()[0], str(exc)) from None
        if _text(reply[0]) == "resync":
            return ResumeResync(_text(reply[1]))
        await self.client.zrem(self.keys.leases(), session_id)  # not detached any more
        return ResumeGranted(
            attachment_generation=int(reply[1]),
            lease_generation=int(reply[2]),
            worker_id=_text(reply[3]),
            next_seq=int(reply[4]),
            session=reply[5] if isinstance(reply[5], bytes) else str(reply[5]).encode(),
            model=_text(reply[6]),
        )

    async def touch(
        self, session_id: str, attachment_generation: int | None = None, pod_id: str = ""
    ) -> int:
        """Refresh the session's last activity: 1, or 0 when it is gone or closed. With the
        caller's attachment generation, also take the session back from a disconnect grace
        a sweep put it in while this attachment still held it (a stalled pod): then 2, and
        its deadline is unindexed."""
        args: list[Any] = [now_ms()]
        if attachment_generation is not None:
            args += [attachment_generation, pod_id]
        touched = int(
            await self.scripts.lease_touch(self.client, [self.keys.session(session_id)], args)
        )
        if touched == TOUCH_REACTIVATED:
            await self.client.zrem(self.keys.leases(), session_id)
        return touched

    async def claim_expiry(self, session_id: str) -> str | None:
        """Claim a due lease; returns the worker to close the session on (janitor)."""
        worker = await self.scripts.lease_expire(
            self.client, [self.keys.session(session_id)], [now_ms()]
        )
        await self.client.zrem(
            self.keys.leases(), session_id
        )  # claimed, resumed or gone: unindexed
        return _text(worker) if worker else None

    async def inbox_append(
        self, worker_id: str, fields: Mapping[str, Any], *, session_id: str | None = None
    ) -> None:
        """One entry (`record.to_fields()`, `encode_entry`) to a worker's inbox: a close, a
        restore, forwarded messages. Outside its budget but counted in it, like the API's
        pipelined commands (services/api/inbox_writer.py). `session_id`: the session whose
        messages it holds, which decides the inbox stripe (shared/redis/inbox_stripes.py);
        None: stripe 0."""
        args: list[Any] = [0, entry_bytes(fields)]
        for name, value in fields.items():
            args += [name, value]
        stripe = 0
        if session_id is not None:
            stripe = (await self.stripes.of(worker_id)).for_session(self.keys, session_id)
        keys = [self.keys.inbox(worker_id, stripe), self.keys.inbox_bytes(worker_id, stripe)]
        await self.scripts.inbox_append(self.client, keys, args)

    async def inbox_forward(
        self,
        worker_id: str,
        session_id: str,
        messages: Sequence[InboxMessage],
        *,
        max_messages: int = 512,
        max_audio: int = 4 * 1024 * 1024,
    ) -> None:
        """Messages of one session read from another worker's inbox, written to this one's
        as they were read (their (attachment, seq) marks with them), in order: the commands
        of a moved session. In as few entries as the limits allow (at most what an API
        pod's writer round puts in one: services/api/inbox_round.py)."""
        batch: list[InboxMessage] = []
        size = 0
        for message in messages:
            audio = len(message.audio)
            if batch and (len(batch) >= max_messages or size + audio > max_audio):
                await self.inbox_append(worker_id, encode_entry(batch), session_id=session_id)
                batch, size = [], 0
            batch.append(message)
            size += audio
        if batch:
            await self.inbox_append(worker_id, encode_entry(batch), session_id=session_id)

    async def inbox_ack(
        self,
        worker_id: str,
        handled: Sequence[tuple[Any, int]],
        *,
        check_empty: bool = True,
        stripe: int = 0,
    ) -> int:
        """Acknowledge and delete handled inbox entries, (entry id, size) each, giving their
        bytes back; in calls of INBOX_ACK_BATCH (Lua unpacks no more than ~8000 values,
        and a backlog of acks after a Redis hiccup can be longer). `check_empty`: the
        last call also sets the byte counter to 0 if the inbox is empty (one XLEN more:
        the worker's batched acks skip it, and ask once when its inbox goes quiet).
        Returns how many went. `stripe`: which of the worker's inbox streams."""
        keys = [self.keys.inbox(worker_id, stripe), self.keys.inbox_bytes(worker_id, stripe)]
        deleted = 0
        starts = range(0, max(len(handled), 1), INBOX_ACK_BATCH)
        for start in starts:
            last = start == starts[-1]
            args: list[Any] = [INBOX_GROUP, int(check_empty and last)]
            for entry_id, size in handled[start : start + INBOX_ACK_BATCH]:
                args += [entry_id, size]
            deleted += int(await self.scripts.inbox_ack(self.client, keys, args))
        return deleted

    async def ack(self, session_id: str, seq: int) -> int:
        return int(
            await self.scripts.journal_ack(self.client, self._session_keys(session_id), [seq])
        )

    async def meta(self, session_id: str) -> dict[str, str]:
        raw = await self.client.hgetall(self.keys.session(session_id))
        return {_text(k): _text(v) for k, v in raw.items()}

    async def journal(
        self, session_id: str, after_seq: int, until_seq: int | None = None
    ) -> list[tuple[int, bytes]]:
        """(seq, event JSON) of the journaled events with after_seq < seq <= until_seq."""
        records = await self.journal_records(session_id, after_seq, until_seq)
        return [(record.seq, record.data) for record in records]

    async def journal_records(
        self, session_id: str, after_seq: int, until_seq: int | None = None
    ) -> list[LiveRecord]:
        """The journaled events with after_seq < seq <= until_seq as the live records they
        went out as (seq, type, response id, JSON), in order: a replay routes on them. An
        entry holds a round (from the seq of its id on): the one holding after_seq + 1 is
        the newest whose id is not past it, and its records up to after_seq are skipped."""
        stream, end = self.keys.events(session_id), "+" if until_seq is None else f"{until_seq}-1"
        holding = await self.client.xrevrange(stream, f"{after_seq + 1}-1", "-", count=1)
        entries = await self.client.xrange(stream, holding[0][0] if holding else "-", end)
        records = [r for entry in entries for r in journal_entry_records(*entry)]
        return [
            r for r in records if after_seq < r.seq and (until_seq is None or r.seq <= until_seq)
        ]
