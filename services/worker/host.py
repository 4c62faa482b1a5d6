"""`WorkerHost`: what the drain and the ownership checks use of the worker process
(`services.worker.process.WorkerProcess` is the one), so that they do not import it."""

from __future__ import annotations

import abc
from typing import Any

from services.worker.command_order import CommandOrder
from services.worker.publisher import RedisEventPublisher
from services.worker.session.manager import SessionManager
from shared.redis.boundary import InboxMessage
from shared.redis.keys import KeySchema
from shared.redis.store import SessionStore
from shared.settings import WorkerSettings


class WorkerHost(abc.ABC):
    settings: WorkerSettings
    redis: Any  # a RedisHandle
    keys: KeySchema
    store: SessionStore
    manager: SessionManager
    publisher: RedisEventPublisher
    order: CommandOrder
    inbox: str

    @property
    @abc.abstractmethod
    def worker_id(self) -> str: ...

    @abc.abstractmethod
    async def report_load(self) -> None:
        """Write the worker's load (`active`) into its registration now."""

    @abc.abstractmethod
    async def release_held(self, session_id: str) -> None:
        """Apply the session's held commands now (`CommandOrder.release`)."""

    @abc.abstractmethod
    async def dispatch(self, message: InboxMessage) -> None:
        """Handle one inbox entry."""
