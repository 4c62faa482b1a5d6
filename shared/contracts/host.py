"""The seam between a session host (the worker's SessionManager) and whoever
feeds it commands and consumes its events (the inline client, the worker's
Redis inbox and publisher)."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any

from shared.contracts.config import DuplexCapabilities
from shared.protocol.duplex import CodedError, DuplexCommand, DuplexErrorEvent, DuplexEvent


class DuplexSessionError(CodedError):
    """A session operation failed with a contract error code."""

    def __init__(
        self, code: str, message: str, *, related_event_id: str | None = None, **extra: Any
    ) -> None:
        param = extra.pop("param", None)  # the field it names, like every coded error's
        super().__init__(code, message, param=param, related_event_id=related_event_id, extra=extra)

    def to_event(self) -> DuplexErrorEvent:
        return DuplexErrorEvent.for_code(
            self.code,
            self.message,
            param=self.param,
            related_event_id=self.related_event_id,
            **self.extra,
        )


class SessionEventSink(abc.ABC):
    """Receives every event of every session of one host, in emission order per session.

    `emit` is called on the host's event loop and must not block.
    """

    @abc.abstractmethod
    def emit(self, session_id: str, event: DuplexEvent) -> None: ...


@dataclasses.dataclass(frozen=True)
class OpenResult:
    session_id: str
    capabilities: DuplexCapabilities
    lease_generation: int
    session: Mapping[str, Any]


class SessionHost(abc.ABC):
    """Sessions by id: open, command, idle lease, close. Detach, resume and the
    disconnect grace are the session store's (Redis), not the host's."""

    @abc.abstractmethod
    async def open(
        self,
        session: Mapping[str, Any],
        *,
        session_id: str | None = None,
        resume_token: str | None = None,
        attachment_generation: int | None = None,
    ) -> OpenResult:
        """Admit and start a session; its first event is `session.created`.
        Raises `DuplexSessionError` (resource_exhausted, session_exists, config codes)."""

    @abc.abstractmethod
    async def submit(self, session_id: str, command: DuplexCommand) -> None:
        """Queue a command. Rejections come back as `error` events on the session's
        stream; an unknown session raises `DuplexSessionError(unknown_session)`."""

    @abc.abstractmethod
    async def close(self, session_id: str, reason: str = "client_close") -> None:
        """Idempotent. `session.closed` is emitted after the stage cleanup."""

    @abc.abstractmethod
    async def touch(self, session_id: str) -> None:
        """Refresh the session's idle deadline."""


__all__ = ["DuplexSessionError", "OpenResult", "SessionEventSink", "SessionHost"]
