"""Lua scripts as objects: loaded from their file, SHA computed up front, reloaded on NOSCRIPT."""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

from redis import exceptions as redis_errors

LUA_PACKAGE = "shared.redis.lua"


class LuaScript:
    def __init__(self, name: str) -> None:
        self.name = name
        self.source = resources.files(LUA_PACKAGE).joinpath(f"{name}.lua").read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    async def __call__(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except redis_errors.NoScriptError:
            # first call on this server (or after SCRIPT FLUSH / a failover): load, retry once
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)

    def queue(self, pipeline: Any, keys: list[str], args: list[Any]) -> None:
        """Queue a call on a pipeline (the script must be loaded: see `ensure_loaded`)."""
        pipeline.evalsha(self.sha, len(keys), *keys, *args)

    async def ensure_loaded(self, client: Any) -> None:
        """Load the script (on a cluster: on every primary). Idempotent."""
        await client.script_load(self.source)


class Scripts:
    """Every script of the key schema, once per process."""

    def __init__(self) -> None:
        self.session_open = LuaScript("session_open")
        self.event_publish = LuaScript("event_publish")
        self.lease_detach = LuaScript("lease_detach")
        self.lease_resume = LuaScript("lease_resume")
        self.lease_touch = LuaScript("lease_touch")
        self.lease_expire = LuaScript("lease_expire")
        self.journal_ack = LuaScript("journal_ack")
        self.inbox_append = LuaScript("inbox_append")
        self.inbox_ack = LuaScript("inbox_ack")
        self.owner_move = LuaScript("owner_move")
        self.restore_progress = LuaScript("restore_progress")

    def all(self) -> list[LuaScript]:
        return [value for value in vars(self).values() if isinstance(value, LuaScript)]

    async def ensure_loaded(self, client: Any) -> None:
        for script in self.all():
            await script.ensure_loaded(client)
