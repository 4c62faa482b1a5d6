"""Waiting on something a client, Redis or /metrics shows (never a fixed sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


async def until(read: Callable[[], Any], ok: Callable[[Any], bool], timeout: float = 30) -> Any:
    """Poll `read()` (awaitable) until `ok` of its value; the value, or an assertion error
    naming the last one after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = await read()
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"still {value!r} after {timeout} s"
        await asyncio.sleep(0.05)
