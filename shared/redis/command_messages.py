"""Client commands as worker inbox entries, and back: the codec half of the API-worker boundary.

Apart from `shared.redis.messages` because it needs the wire codec (and numpy with it),
which the readers of Redis (`duplex sessions`, `duplex workers`) must not load.
"""

from __future__ import annotations

import dataclasses

from shared.protocol.duplex import AppendAudio, DuplexCommand, parse_client_event
from shared.redis.messages import COMMAND, InboxMessage


def command_message(
    session_id: str, attachment: int, seq: int, command: DuplexCommand
) -> InboxMessage:
    if not isinstance(command, AppendAudio):
        return InboxMessage(COMMAND, session_id, attachment, seq, command.to_dict())
    # the audio travels raw beside the payload: to_dict() would base64-encode it only for
    # it to be dropped (17% of the API pod's time under 8 MiB appends, bench/exhaustion)
    payload = dataclasses.replace(command, audio=b"").to_dict()
    payload.pop("audio", None)
    audio = command.audio
    return InboxMessage(COMMAND, session_id, attachment, seq, payload, audio)


def command_from_message(message: InboxMessage) -> DuplexCommand:
    command = parse_client_event(message.payload)
    if isinstance(command, AppendAudio) and message.audio:
        command = dataclasses.replace(command, audio=message.audio)
    return command
