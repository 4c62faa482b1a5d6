"""The inbox envelope and control-notice names, kept where the API pod's modules import them.

Every record of the API-to-worker boundary lives in `shared.redis.boundary`; new code uses
its typed records (`OpenRequest`, `CommandRecord`, `CloseRequest`, `TouchRequest`,
`ChatRequest`, `ControlNotice`) rather than these names.
"""

from shared.redis.boundary import (
    CHAT,
    CLOSE,
    COMMAND,
    CONTROL_PREFIX,
    MIN_ENTRY_BYTES,
    OPEN,
    TAKEOVER,
    TOUCH,
    InboxMessage,
    entry_bytes,
    takeover_notice,
)

__all__ = [
    "CHAT",
    "CLOSE",
    "COMMAND",
    "CONTROL_PREFIX",
    "MIN_ENTRY_BYTES",
    "OPEN",
    "TAKEOVER",
    "TOUCH",
    "InboxMessage",
    "entry_bytes",
    "takeover_notice",
]
