"""The OpenAI Realtime API codec (Tier 1). Imports nothing else of ours.

Consumers inside duplex-serve use `shared.protocol.duplex`, which re-exports
what it does not extend.
"""

from shared.protocol.realtime.commands import (
    REALTIME_CLIENT_COMMANDS,
    CommandContext,
    RealtimeCommand,
    parse_realtime_command,
)
from shared.protocol.realtime.errors import (
    ERROR_TYPES,
    INVALID_REQUEST_ERROR,
    RATE_LIMIT_ERROR,
    SERVER_ERROR,
    RealtimeProtocolError,
)
from shared.protocol.realtime.events import REALTIME_SERVER_EVENTS, RealtimeEvent
from shared.protocol.realtime.formats import AudioFormat, parse_audio_format

__all__ = [
    "ERROR_TYPES",
    "INVALID_REQUEST_ERROR",
    "RATE_LIMIT_ERROR",
    "REALTIME_CLIENT_COMMANDS",
    "REALTIME_SERVER_EVENTS",
    "SERVER_ERROR",
    "AudioFormat",
    "CommandContext",
    "RealtimeCommand",
    "RealtimeEvent",
    "RealtimeProtocolError",
    "parse_audio_format",
    "parse_realtime_command",
]
