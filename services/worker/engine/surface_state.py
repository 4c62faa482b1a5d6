"""`NativeSurfaceState`: what Moshi's and GPT-Live's surfaces keep of a session beyond the
session itself (native_surfaces.py projects its events with it). One field of the session's
`EngineSession`, in its checkpoint: it moves with the session."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass
class NativeSurfaceState:
    """What these surfaces keep of a session beyond the session itself (in its checkpoint)."""

    #: `session.started` was sent (the model's first "ready")
    started: bool = False
    #: GPT-Live's mute: the model hears silence in place of the client's audio
    muted: bool = False
    #: the input stream position whose usage was last reported
    usage_reported_ms: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> NativeSurfaceState:
        data = data or {}
        return cls(
            started=bool(data.get("started", False)),
            muted=bool(data.get("muted", False)),
            usage_reported_ms=int(data.get("usage_reported_ms", 0)),
        )
