"""`duplex sessions ls|show|tail|close` and `duplex workers`: live state, read from Redis.

Everything here is what `redis-cli` shows (docs/redis-keys.md), laid out for
people; `--json` prints the raw records for scripts.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, TextIO

import orjson

from shared.redis.connection import RedisHandle
from shared.redis.keys import KeySchema
from shared.redis.messages import CLOSE, InboxMessage
from shared.redis.store import SessionStore


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _age(ms: str | None) -> str:
    if not ms:
        return "-"
    seconds = time.time() - int(ms) / 1000
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


class Admin:
    def __init__(self, redis: RedisHandle, keys: KeySchema, out: TextIO = sys.stdout) -> None:
        self.client = redis.client
        self.keys = keys
        self.store = SessionStore(self.client, keys)
        self.out = out

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)

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
                row.pop("config", None)
                row.pop("session", None)
                self._print(orjson.dumps(row).decode())
            return
        self._print(
            f"{'SESSION':41} {'STATE':9} {'WORKER':24} {'MODEL':8} {'AGE':>6} {'ATT':>4} {'SEQ':>6}"
        )
        for row in rows:
            state, worker, model = (
                row.get("state", "?"),
                row.get("worker", "?"),
                row.get("model", "?"),
            )
            self._print(
                f"{row['session_id']:41} {state:9} {worker[:24]:24} {model[:8]:8} "
                f"{_age(row.get('created_at')):>6} {row.get('attachment_generation', '?'):>4} "
                f"{row.get('next_seq', '?'):>6}"
            )
        self._print(f"{len(rows)} sessions")

    async def show(self, session_id: str, last: int = 10) -> int:
        meta = await self.store.meta(session_id)
        if not meta:
            self._print(f"no session {session_id}")
            return 1
        for field in sorted(meta):
            if field not in ("config", "session"):
                self._print(f"{field:24} {meta[field]}")
        first = max(0, int(meta.get("next_seq", "0")) - last)
        self._print(f"-- last {last} events (journal from seq {first + 1})")
        for seq, data in await self.store.journal(session_id, first):
            self._print(f"{seq:>6} {_text(data)[:200]}")
        return 0

    async def tail(self, session_id: str, limit: int | None = None) -> int:
        """Follow the journal (every journaled event, as the client receives it)."""
        stream = self.keys.events(session_id)
        last_id = "$"
        seen = 0
        while limit is None or seen < limit:
            reply = await self.client.xread({stream: last_id}, block=1000, count=100)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = _text(entry_id)
                    self._print(_text(fields[b"data"]))
                    seen += 1
            if not reply and not await self.client.exists(self.keys.session(session_id)):
                self._print(f"session {session_id} is gone")
                return 1
        return 0

    async def close(self, session_id: str, reason: str) -> int:
        meta = await self.store.meta(session_id)
        if not meta or meta.get("state") == "closed":
            self._print(f"no open session {session_id}")
            return 1
        message = InboxMessage(CLOSE, session_id, 0, 0, {"reason": reason})
        await self.client.xadd(self.keys.inbox(meta["worker"]), message.to_fields())
        self._print(f"asked {meta['worker']} to close {session_id} ({reason})")
        return 0

    async def workers(self, as_json: bool) -> None:
        beats = await self.client.zrange(self.keys.workers(), 0, -1, withscores=True)
        rows = []
        for worker_id, score in beats:
            info = {
                _text(k): _text(v)
                for k, v in (await self.client.hgetall(self.keys.worker(_text(worker_id)))).items()
            }
            info.pop("capabilities", None)
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
            return await admin.show(session_id)
        if action == "tail":
            return await admin.tail(session_id, options.get("limit"))
        return await admin.close(session_id, options.get("reason") or "admin_close")
    finally:
        await redis.close()


def main(
    redis: RedisHandle, prefix: str, action: str, session_id: str | None, **options: Any
) -> int:
    return asyncio.run(run(redis, prefix, action, session_id, **options))
