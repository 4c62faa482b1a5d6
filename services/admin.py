"""`duplex sessions ls|show|tail|close` and `duplex workers`: live state, read from Redis.

Everything here is what `redis-cli` shows (docs/redis-keys.md), laid out for
people; `--json` prints the raw records for scripts.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

import orjson
from redis import exceptions as redis_errors

from services.exit_codes import EXIT_NOT_AVAILABLE
from shared.redis.boundary import CloseRequest, WorkerRegistration
from shared.redis.connection import RedisHandle
from shared.redis.keys import KeySchema
from shared.redis.live_message import LiveRecord, journal_entry_records
from shared.redis.store import SessionStore


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _journaled(wire_type: str, data: bytes) -> str:
    """A journaled event as `tail` prints it: its JSON; a record that is not JSON but bytes
    (a moshi session's audio, `moshi.audio`) as its type and size."""
    if not data.startswith(b"{"):
        return orjson.dumps({"type": wire_type, "bytes": len(data)}).decode()
    return _text(data)


def surface_of(meta: dict[str, str]) -> str:
    """The protocol a session was opened on, from the opening config in its hash: duplex,
    openai (plain /v1/realtime), moshi (/api/chat) or live (/v1/live/sessions)."""
    try:
        config = orjson.loads(meta.get("config") or "{}")
    except orjson.JSONDecodeError:
        return "?"
    surface = config.get("duplex_surface") if isinstance(config, dict) else None
    return surface if isinstance(surface, str) and surface else "duplex"


def restore_line(data: str) -> str:
    """A restore's progress (the hash's `restore`, written by the worker replaying it) for
    people: frames replayed of frames to replay, and its pace against real time."""
    try:
        progress = orjson.loads(data)
        frames, replayed = int(progress["frames"]), int(progress["replayed"])
        seconds, pace = float(progress["seconds"]), float(progress["pace"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return f"? ({data[:80]})"
    if progress.get("done"):
        return f"done: {frames} frames replayed in {seconds:.2f} s ({pace:.1f}x real time)"
    share = 100 * replayed / frames if frames else 100.0
    return (
        f"replaying: {replayed} of {frames} frames ({share:.0f}%) in {seconds:.2f} s, "
        f"{pace:.1f}x real time so far"
    )


def _age(ms: str | None) -> str:
    if not ms:
        return "-"
    seconds = time.time() - int(ms) / 1000
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def _closed_reason(data: bytes) -> str:
    try:
        return str(orjson.loads(data).get("reason", "-"))
    except orjson.JSONDecodeError:
        return "-"


def _records(entries: Iterable[tuple[bytes, dict[bytes, bytes]]]) -> list[LiveRecord]:
    """The events of journal entries, in order (an entry holds a publisher round)."""
    return [record for entry in entries for record in journal_entry_records(*entry)]


class Admin:
    #: how long one blocking read of `tail` waits before it looks at the session's state
    block_ms = 1000

    def __init__(
        self,
        redis: RedisHandle,
        keys: KeySchema,
        out: TextIO | None = None,
        err: TextIO | None = None,
    ) -> None:
        self.client = redis.client
        self.keys = keys
        self.store = SessionStore(self.client, keys)
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def _note(self, line: str) -> None:
        """What is said about the output goes to stderr: stdout stays one event a line."""
        print(line, file=self.err, flush=True)

    async def sessions(self) -> list[dict[str, str]]:
        pattern = self.keys.session("*")
        rows = []
        async for key in self.client.scan_iter(match=pattern, count=500):
            name = _text(key)
            if not name.endswith("}"):
                continue  # the journal, not the meta hash
            session_id = name[name.index("{") + 1 : -1]
            meta = await self.store.meta(session_id)
            if meta:
                rows.append({"session_id": session_id, **meta})
        return sorted(rows, key=lambda row: row.get("created_at", ""))

    async def ls(self, as_json: bool) -> None:
        rows = await self.sessions()
        if as_json:
            for row in rows:
                row["surface"] = surface_of(row)
                row.pop("config", None)
                row.pop("session", None)
                self._print(orjson.dumps(row).decode())
            return
        self._print(
            f"{'SESSION':41} {'STATE':9} {'WORKER':24} {'MODEL':8} {'SURFACE':7} {'AGE':>6} "
            f"{'ATT':>4} {'SEQ':>6}"
        )
        for row in rows:
            state, worker, model = (
                row.get("state", "?"),
                row.get("worker", "?"),
                row.get("model", "?"),
            )
            self._print(
                f"{row['session_id']:41} {state:9} {worker[:24]:24} {model[:8]:8} "
                f"{surface_of(row):7} {_age(row.get('created_at')):>6} "
                f"{row.get('attachment_generation', '?'):>4} {row.get('next_seq', '?'):>6}"
            )
        self._print(f"{len(rows)} sessions")

    async def show(self, session_id: str, last: int = 10) -> int:
        meta = await self.store.meta(session_id)
        if not meta:
            self._note(f"no session {session_id}")
            return 1
        for field in sorted(meta):
            if field not in ("config", "session"):
                self._print(f"{field:24} {meta[field]}")
        self._print(f"{'surface':24} {surface_of(meta)}")
        if meta.get("model_bytes"):
            # a model-native session's model history: what a restore replays
            size, record = int(meta["model_bytes"]), int(meta.get("model_record_bytes") or 0)
            frames = f", {size // record} frames" if record else ""
            self._print(
                f"-- model history {self.store.keys.model_history(session_id)}: "
                f"{size} bytes{frames}"
            )
        if meta.get("restore"):
            self._print(f"-- restore: {restore_line(meta['restore'])}")
        first = max(0, int(meta.get("next_seq", "0")) - last)
        self._print(f"-- last {last} events (journal from seq {first + 1})")
        for seq, data in await self.store.journal(session_id, first):
            self._print(f"{seq:>6} {_text(data)[:200]}")
        return 0

    async def tail(self, session_id: str, lines: int = 10, limit: int | None = None) -> int:
        """`tail -f` on the journal: the last `lines` journaled events at once, then every
        new one as it is journaled, until `limit` events were printed or the session ends.

        It follows from the id of the last entry it printed, never from `$`: an event
        journaled between two reads is in the next read, not lost. Exit codes: 0 when the
        limit was reached or the session closed (its last events printed), 1 when there is
        no such session, it is gone from Redis, or its journal overflowed (nothing more is
        journaled to follow)."""
        stream = self.keys.events(session_id)
        meta = await self.store.meta(session_id)
        if not meta:
            self._note(f"no session {session_id}")
            return 1
        # an entry holds a round of one or more events: `lines` entries hold `lines` events
        newest_first = await self.client.xrevrange(stream, "+", "-", count=max(lines, 1))
        # an empty journal is followed from its very start, so its first event is printed
        last_id = _text(newest_first[0][0]) if newest_first else "0-0"
        records = _records(reversed(newest_first))
        records = records[-lines:] if lines > 0 else []
        printed = 0
        while True:
            for record in records:
                if limit is not None and printed >= limit:
                    return 0
                self._print(_journaled(record.wire_type, record.data))
                printed += 1
                if record.wire_type == "session.closed":
                    self._note(f"session {session_id} closed ({_closed_reason(record.data)})")
                    return 0
            if limit is not None and printed >= limit:
                return 0
            if meta.get("state") == "closed":
                # set by the script that journals session.closed: nothing more will come
                self._note(f"session {session_id} closed")
                return 0
            if meta.get("journal_overflow") == "1":
                self._note(f"session {session_id}: its journal overflowed, nothing to follow")
                return 1
            reply = await self.client.xread({stream: last_id}, block=self.block_ms, count=100)
            entries = [entry for _, batch in reply or [] for entry in batch]
            records = _records(entries)
            if entries:
                last_id = _text(entries[-1][0])
                continue
            meta = await self.store.meta(session_id)  # a quiet second: has it ended?
            if not meta:
                self._note(f"session {session_id} is gone (expired from Redis)")
                return 1

    async def close(self, session_id: str, reason: str) -> int:
        meta = await self.store.meta(session_id)
        if not meta or meta.get("state") == "closed":
            self._note(f"no open session {session_id}")
            return 1
        close = CloseRequest(session_id, reason)
        await self.store.inbox_append(meta["worker"], close.to_fields(), session_id=session_id)
        self._print(f"asked {meta['worker']} to close {session_id} ({reason})")
        return 0

    async def workers(self, as_json: bool) -> None:
        beats = await self.client.zrange(self.keys.workers(), 0, -1, withscores=True)
        rows = []
        for worker_id, score in beats:
            registration = WorkerRegistration.from_hash(
                _text(worker_id), await self.client.hgetall(self.keys.worker(_text(worker_id)))
            )
            # the hash's fields as redis-cli shows them, but the capabilities (too long)
            info = {
                field: _text(value)
                for field, value in (registration.to_hash() if registration else {}).items()
                if field != "capabilities"
            }
            rows.append(
                {
                    "worker_id": _text(worker_id),
                    "heartbeat_age_s": round(time.time() - score / 1000, 1),
                    **info,
                }
            )
        if as_json:
            for row in rows:
                self._print(orjson.dumps(row).decode())
            return
        self._print(f"{'WORKER':32} {'MODEL':10} {'LOAD':>10} {'HEARTBEAT':>10} {'UP':>6}")
        for row in rows:
            load = f"{row.get('active', '?')}/{row.get('max_sessions', '?')}"
            self._print(
                f"{row['worker_id'][:32]:32} {row.get('model', '?')[:10]:10} {load:>10} "
                f"{row['heartbeat_age_s']:>9}s {_age(row.get('started_at')):>6}"
            )


async def run(
    redis: RedisHandle, prefix: str, action: str, session_id: str | None, **options: Any
) -> int:
    admin = Admin(redis, KeySchema(prefix))
    try:
        if action == "workers":
            await admin.workers(options.get("as_json", False))
            return 0
        if action == "ls":
            await admin.ls(options.get("as_json", False))
            return 0
        if session_id is None:
            print(f"duplex sessions {action} needs a session id", file=sys.stderr)
            return 2
        if action == "show":
            return await admin.show(session_id, options.get("lines", 10))
        if action == "tail":
            return await admin.tail(session_id, options.get("lines", 10), options.get("limit"))
        return await admin.close(session_id, options.get("reason") or "admin_close")
    finally:
        await redis.close()


def main(
    redis: RedisHandle, prefix: str, action: str, session_id: str | None, **options: Any
) -> int:
    try:
        return asyncio.run(run(redis, prefix, action, session_id, **options))
    except redis_errors.ConnectionError as exc:
        print(f"cannot reach Redis ({redis.description}): {exc}", file=sys.stderr)
        return EXIT_NOT_AVAILABLE
    except KeyboardInterrupt:  # Ctrl-C ends `tail`: not an error worth a traceback
        return 130
