"""The duplex wire codec: Tier 1 re-exported, Tier 2 and Tier 3 added.

This package is the ONE door the rest of duplex-serve uses for the wire
protocol; nothing outside `shared.protocol` imports `shared.protocol.realtime`.
Registries for introspection:

- `SERVER_EVENT_TYPES`: the 45 server event types -> class (`SERVER_EVENT_TIERS`: tier of each)
- `CLIENT_COMMAND_TYPES`: the 17 client commands -> class (`CLIENT_COMMAND_TIERS`)
- `ENVELOPE_EVENT_TYPES`: the 3 envelope-only client events
- `CLIENT_EVENT_ALIASES`: alias -> canonical type
- `ERROR_CODES`: every error code -> `ErrorCode(code, error_type, description, retryable)`
"""

from shared.protocol.duplex.audio import *  # noqa: F403
from shared.protocol.duplex.audio import __all__ as _audio_names
from shared.protocol.duplex.commands import *  # noqa: F403
from shared.protocol.duplex.commands import __all__ as _command_names
from shared.protocol.duplex.errors import (
    ERROR_CODES,
    ERROR_TYPES_BY_CODE,
    CodedError,
    ErrorCode,
    RealtimeProtocolError,
    error_type_for,
    retryable_for,
)
from shared.protocol.duplex.events import *  # noqa: F403
from shared.protocol.duplex.events import __all__ as _event_names
from shared.protocol.duplex.live import *  # noqa: F403
from shared.protocol.duplex.live import __all__ as _live_names
from shared.protocol.duplex.map_realtime import *  # noqa: F403
from shared.protocol.duplex.map_realtime import __all__ as _map_names
from shared.protocol.duplex.moshi import *  # noqa: F403
from shared.protocol.duplex.moshi import __all__ as _moshi_names
from shared.protocol.duplex.session import *  # noqa: F403
from shared.protocol.duplex.session import __all__ as _session_names
from shared.protocol.realtime.errors import (
    ERROR_TYPES,
    INVALID_REQUEST_ERROR,
    RATE_LIMIT_ERROR,
    SERVER_ERROR,
)
from shared.protocol.realtime.formats import (
    G711_ALAW,
    G711_ULAW,
    INPUT_ENCODINGS,
    OUTPUT_ENCODINGS,
    PCM16,
    PCM_F32LE,
    WAV,
    AudioFormat,
    parse_audio_format,
)
from shared.protocol.realtime.items import item_text, normalize_item
from shared.protocol.realtime.wire import WireFormatError, dumps, loads, new_event_id

__all__ = [
    *_audio_names,
    *_command_names,
    *_event_names,
    *_live_names,
    *_map_names,
    *_moshi_names,
    *_session_names,
    "ERROR_CODES",
    "ERROR_TYPES",
    "ERROR_TYPES_BY_CODE",
    "G711_ALAW",
    "G711_ULAW",
    "INPUT_ENCODINGS",
    "INVALID_REQUEST_ERROR",
    "OUTPUT_ENCODINGS",
    "PCM16",
    "PCM_F32LE",
    "RATE_LIMIT_ERROR",
    "SERVER_ERROR",
    "WAV",
    "AudioFormat",
    "ErrorCode",
    "CodedError",
    "RealtimeProtocolError",
    "WireFormatError",
    "dumps",
    "error_type_for",
    "item_text",
    "loads",
    "new_event_id",
    "normalize_item",
    "parse_audio_format",
    "retryable_for",
]
