"""The API side of the API-to-worker boundary: every entry the pod writes to a worker's inbox.

`WorkerClient` builds the inbox messages (open, command, close, touch, chat) and hands them
to the pod's one `InboxWriter`, which packs each round's messages for a worker into one
entry. Appends may linger there for company (`send_command`'s future settles once the entry
is written); everything else sends its round at once. Which messages count against the
inbox's byte budget is decided here, once:

- client commands count, appends first: a client that writes faster than its worker reads
  is refused with `InboxFull` (the caller answers `input_backpressure`);
- opens, touches, closes and the small commands that keep a session alive or stop it
  (`UNBUDGETED`) are never refused, so a session's neighbour flooding the worker cannot
  cut them off;
- chat requests count, like commands.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.api.inbox_writer import CommandSeq, InboxWriter
from shared.protocol.duplex import DuplexCommand
from shared.redis.boundary import (
    APPEND_TYPE,
    ChatRequest,
    CloseRequest,
    CommandRecord,
    InboxRecord,
    OpenRequest,
    TouchRequest,
)

#: client commands that pass a worker's full inbox: small, and what keeps a session alive
#: or stops it (everything else, appends first, counts against the inbox's budget)
UNBUDGETED = frozenset(
    {
        "session.heartbeat",
        "session.close",
        "response.cancel",
        "input.cancel",
        "barge_in",
        "input_audio_buffer.clear",
        "output_audio_buffer.clear",
        "playback.ack",
    }
)


class WorkerClient:
    """Writes to workers' inboxes. Raises `InboxFull` for a budgeted entry the budget
    refused, or what Redis raised; an entry is written whole or not at all."""

    def __init__(self, inbox: InboxWriter) -> None:
        self._inbox = inbox

    async def open(self, worker_id: str, session_id: str, session: dict[str, Any]) -> None:
        """Ask the worker to admit a session; attachment generation 1 is the opener's."""
        await self._write(worker_id, OpenRequest(session_id, session))

    async def command(
        self,
        worker_id: str,
        session_id: str,
        attachment: int,
        seq: int | CommandSeq,
        command: DuplexCommand,
    ) -> None:
        """A client command, with the attachment's command seq (redeliveries are dropped by it)."""
        await self.send_command(worker_id, session_id, attachment, seq, command)

    def send_command(
        self,
        worker_id: str,
        session_id: str,
        attachment: int,
        seq: int | CommandSeq,
        command: DuplexCommand,
    ) -> asyncio.Future[None]:
        """Queue a client command; the future settles once it is written (or refused).
        `seq`: the command's seq, or the attachment's `CommandSeq`, which hands it out when
        the command's entry is built (a refused entry gives it back). Appends linger."""
        fixed = seq if isinstance(seq, int) else 0
        message = CommandRecord(session_id, attachment, fixed, command)
        return self._inbox.send(
            worker_id,
            message,
            budgeted=command.TYPE not in UNBUDGETED,
            seqs=None if isinstance(seq, int) else seq,
            lingers=command.TYPE == APPEND_TYPE,
        )

    async def close(self, worker_id: str, session_id: str, attachment: int, reason: str) -> None:
        await self._write(worker_id, CloseRequest(session_id, reason, attachment))

    async def touch(self, worker_id: str, session_id: str, attachment: int) -> None:
        """The session has a socket again (a resume): the worker refreshes its idle clock."""
        await self._write(worker_id, TouchRequest(session_id, attachment))

    async def chat(self, worker_id: str, request_id: str, messages: list[Any]) -> None:
        """A chat completion request; the worker answers on the request's reply list."""
        await self._write(worker_id, ChatRequest(request_id, messages))

    async def stop(self) -> None:
        """Stop the writer: what is still queued fails in its callers."""
        await self._inbox.stop()

    async def _write(self, worker_id: str, record: InboxRecord) -> None:
        await self._inbox.send(worker_id, record, budgeted=budgeted(record))


def budgeted(record: InboxRecord) -> bool:
    """Does this entry count against the inbox's byte budget (and so may be refused)?"""
    if isinstance(record, ChatRequest):
        return True
    return isinstance(record, CommandRecord) and record.command_type not in UNBUDGETED
