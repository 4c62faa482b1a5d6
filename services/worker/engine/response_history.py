"""`ResponseHistory`: what history keeps of a session's responses, following the playback
ledger; the `ResponseController` holds one (`responses.history`).

History follows the ledger: a completed (or incomplete) response keeps all it generated
(under `commit_all_on_done`) or what the client acknowledged (`ack_only`); a cancelled
one keeps what was played; a failed one leaves nothing in history. `playback.ack` moves
the ledger (and answers with `playback.acknowledged`), `conversation.item.truncate` cuts
an item to the audio the client heard, and `history_item` writes the committed words
into the response's message item.

A text response has no audio: its ledger stays at 0 ms, so what it generated is all
committed, whatever the policy; truncating it is refused past 0 ms like any item's audio.

It is given the session and its way out (`emit`), nothing else; every method runs on the
session's runner task.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

from services.worker.engine.engine_session import EngineSession
from services.worker.engine.response import FAILED, ActiveResponse
from shared.contracts import DuplexSessionError
from shared.protocol.duplex import (
    ACK_ONLY,
    AckPlayback,
    DuplexConversationItemTruncated,
    DuplexEvent,
    PlaybackAcknowledged,
    TruncateItem,
)


class ResponseHistory:
    def __init__(self, session: EngineSession, emit: Callable[[DuplexEvent], None]) -> None:
        self.session = session
        self.emit = emit

    def acknowledge_playback(self, command: AckPlayback) -> None:
        session = self.session
        if command.response_id is not None:
            response = session.responses.get(command.response_id)
        else:
            response = session.active or session.last_response
        if response is None:
            raise DuplexSessionError("playback_item_not_found", "no response to acknowledge")
        if command.item_id is not None and command.item_id != response.item_id:
            raise DuplexSessionError(
                "playback_item_mismatch",
                f"{command.item_id!r} is not {response.response_id}'s item",
            )
        response.playback.acknowledge(command.played_ms, command.committed_ms, command.truncate)
        # whether history now keeps what was acknowledged: a boolean, as in vLLM-Omni
        # 0.30.0 (its harness checks `is True`); the words are in conversation.item.*
        history_committed = response.status != FAILED and (
            command.truncate
            or session.config.playback_commit_policy == ACK_ONLY
            or response.status != "in_progress"
        )
        if history_committed:
            self.history_item(response, item_status(response))
        self.emit(
            PlaybackAcknowledged(
                event={
                    "type": "playback.acknowledged",
                    "session_id": session.session_id,
                    "epoch": session.epoch,
                    "response_id": response.response_id,
                    "item_id": response.item_id,
                    "played_ms": response.playback.played_ms,
                    "committed_ms": response.playback.committed_ms,
                    "truncate": command.truncate,
                    "playback": response.playback.to_dict(),
                    "history_committed": history_committed,
                }
            )
        )

    def truncate_item(self, command: TruncateItem) -> None:
        session = self.session
        if not session.capabilities.supports_audio_truncate:
            raise DuplexSessionError("bad_event", "this model does not support truncation")
        session.conversation.get(command.item_id)  # item_not_found
        response = session.response_by_item(command.item_id)
        if response is None:
            raise DuplexSessionError(
                "bad_event", f"item {command.item_id!r} has no assistant audio"
            )
        generated_ms = response.playback.generated_ms
        # audio_end_ms is whole milliseconds on the wire and the item's length is not: clients
        # (the Agents SDK among them) clamp to the length rounded up, so that much still fits
        if command.audio_end_ms > math.ceil(generated_ms - 1e-6):
            raise DuplexSessionError(
                "bad_event", f"audio_end_ms is past the item's {generated_ms} ms"
            )
        # the client heard exactly this much: history keeps that prefix
        heard_ms = min(float(command.audio_end_ms), generated_ms)
        response.playback.played_ms = response.playback.committed_ms = heard_ms
        self.history_item(response, item_status(response))
        self.emit(
            DuplexConversationItemTruncated(
                item_id=command.item_id,
                content_index=command.content_index,
                audio_end_ms=int(command.audio_end_ms),
                event=command.to_dict(),
            )
        )

    def history_item(self, response: ActiveResponse, status: str) -> dict[str, Any]:
        """Write the response's committed text into its history item; return the item."""
        text = (
            response.transcript
            if response.playback.committed_ms >= response.playback.generated_ms
            else response.committed_text(response.playback.committed_ms)
        )
        item = response.item(status, transcript=text)
        with contextlib.suppress(DuplexSessionError):  # deleted by the client, or never
            # announced (the openai surface): nothing to update
            self.session.conversation.get(response.item_id).update(item)
        return item


def item_status(response: ActiveResponse) -> str:
    return {"completed": "completed", "in_progress": "in_progress"}.get(
        response.status, "incomplete"
    )
