"""`EngineSession`: every piece of state of one session, written only on its runner's task
(the single-writer invariant of `runner.py`)."""

from __future__ import annotations

import collections
import dataclasses
import uuid
from typing import Any

from services.worker.engine.conversation import Conversation
from services.worker.engine.lease import LeaseState
from services.worker.engine.ledgers import InputLedger
from services.worker.engine.response import ActiveResponse
from services.worker.engine.surface_state import NativeSurfaceState
from shared.contracts import CommittedTurn, DuplexCapabilities, DuplexFence, DuplexSessionConfig

#: Responses kept for late playback acks and truncation (older ones are forgotten).
RETAINED_RESPONSES = 16


def new_item_id() -> str:
    return "item_" + uuid.uuid4().hex


@dataclasses.dataclass
class EngineSession:
    session_id: str
    config: DuplexSessionConfig
    runtime_config: dict[str, Any]
    capabilities: DuplexCapabilities
    lease: LeaseState
    input: InputLedger
    conversation: Conversation = dataclasses.field(default_factory=Conversation)
    epoch: int = 0
    turn_id: int = 0
    turn_state: str = "idle"
    #: bumped by input.cancel: appends and commits in flight from before are dropped
    input_generation: int = 0
    active: ActiveResponse | None = None
    last_response: ActiveResponse | None = None
    responses: collections.OrderedDict[str, ActiveResponse] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    pending_turns: collections.deque[CommittedTurn] = dataclasses.field(
        default_factory=collections.deque
    )
    pending_input_bytes: int = 0
    pending_commits: int = 0
    audio_started: bool = False
    #: user items created by the client since the last response (a text-only turn)
    unanswered_items: int = 0
    overlap_reported: str | None = None  # response id whose overlap was reported
    #: what Moshi's and GPT-Live's surfaces keep of the session (native_surfaces.py)
    surface_state: NativeSurfaceState = dataclasses.field(default_factory=NativeSurfaceState)

    @property
    def fence(self) -> DuplexFence:
        return DuplexFence(self.session_id, self.epoch, self.turn_id)

    @property
    def model_native(self) -> bool:
        return self.capabilities.supports_model_native_turn_policy and self.config.model_native

    @property
    def busy(self) -> bool:
        """Active operations keep a session from idling out."""
        return self.active is not None or self.pending_commits > 0 or self.pending_input_bytes > 0

    def remember(self, response: ActiveResponse) -> None:
        self.responses[response.response_id] = response
        while len(self.responses) > RETAINED_RESPONSES:
            self.responses.popitem(last=False)

    def response_by_item(self, item_id: str) -> ActiveResponse | None:
        return next((r for r in self.responses.values() if r.item_id == item_id), None)

    def session_object(self) -> dict[str, Any]:
        """The session object of session.created / session.updated / session.resumed."""
        current = self.active or self.last_response
        return {
            **self.config.to_realtime(),
            "id": self.session_id,
            # sent only while the session is live (session.created, session.updated): its
            # lifecycle is its record's `Phase` (table.py), nothing here keeps a second one
            "state": "open",
            "turn_state": self.turn_state,
            "epoch": self.epoch,
            "turn_id": self.turn_id,
            "active_request_id": self.active.request_id if self.active else None,
            "active_response_id": self.active.response_id if self.active else None,
            "active_response_turn_id": self.active.fence.turn_id if self.active else None,
            "playback": current.playback.to_dict() if current else None,
            "capabilities": self.capabilities.to_realtime(),
        }
