"""Client commands as inbox entries and back, kept where the API pod's modules import them.

`shared.redis.boundary.CommandRecord` is the record; these two functions are its old names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.redis.boundary import CommandRecord, InboxMessage

if TYPE_CHECKING:
    from shared.protocol.duplex import DuplexCommand


def command_message(
    session_id: str, attachment: int, seq: int, command: DuplexCommand
) -> InboxMessage:
    return CommandRecord(session_id, attachment, seq, command).to_message()


def command_from_message(message: InboxMessage) -> DuplexCommand:
    """The command an entry carries, rebuilt without validating it again."""
    return CommandRecord.from_message(message).command
