"""One response's state and the events of its canonical sequence (contract 1.2).

start:   response.created -> conversation.item.added -> conversation.item.created
         -> response.output_item.added
speak:   response.speak -> response.content_part.added            (before the first audio)
audio:   response.output_audio.delta + response.output_audio_transcript.delta
finish:  response.output_audio.done -> response.output_audio_transcript.done
         -> response.content_part.done -> response.output_item.done
         -> conversation.item.done -> response.done -> rate_limits.updated
The finish chain closes only what was opened, so a response cancelled before
its first audio ends with output_item.done -> conversation.item.done ->
response.done -> rate_limits.updated.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from services.worker.session.ledgers import PlaybackLedger
from shared.contracts import DuplexFence
from shared.protocol.duplex import (
    ConversationItemAdded,
    ConversationItemCreated,
    ConversationItemDone,
    DuplexEvent,
    DuplexOutputAudioDelta,
    DuplexResponseCreated,
    DuplexResponseDone,
    OutputAudioEncoder,
    RateLimitsUpdated,
    ResponseContentPartAdded,
    ResponseContentPartDone,
    ResponseOutputAudioDone,
    ResponseOutputAudioTranscriptDelta,
    ResponseOutputAudioTranscriptDone,
    ResponseOutputItemAdded,
    ResponseOutputItemDone,
    ResponseSpeak,
    error_type_for,
    retryable_for,
)

COMPLETED, CANCELLED, FAILED = "completed", "cancelled", "failed"


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


@dataclasses.dataclass
class ActiveResponse:
    response_id: str
    fence: DuplexFence
    request_id: str
    encoder: OutputAudioEncoder
    modalities: tuple[str, ...]
    output_index: int = 0
    content_index: int = 0
    speaking: bool = False
    transcript: str = ""
    marks: list[dict[str, float]] = dataclasses.field(default_factory=list)
    playback: PlaybackLedger = dataclasses.field(default_factory=PlaybackLedger)
    status: str = "in_progress"
    reason: str | None = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: function_call items the stage made, emitted when the response completes (tool_calls.py)
    function_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: the client's `response.create` metadata, echoed by the openai surface (`surface.py`)
    metadata: dict[str, str] | None = None

    @property
    def item_id(self) -> str:
        return "item_" + self.response_id

    @property
    def format_name(self) -> str:
        return self.encoder.format.encoding

    def committed_text(self, committed_ms: float) -> str:
        """The transcript up to `committed_ms` of audio, from the audio/text marks."""
        chars = 0
        for mark in self.marks:
            if mark["audio_end_ms"] <= committed_ms + 1e-6:
                chars = int(mark["text_chars"])
        return self.transcript[:chars]

    def item(self, status: str, transcript: str | None = None) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [
                {
                    "type": "output_audio",
                    "transcript": self.transcript if transcript is None else transcript,
                }
            ],
        }

    def response_object(
        self, status: str, output: list[dict[str, Any]], extra: dict[str, Any] | None = None
    ):
        details: dict[str, Any] | None = (
            None if self.reason is None else {"type": status, "reason": self.reason}
        )
        if details is not None and status == FAILED:
            # OpenAI's failed status_details: the error that ended it (its code is the reason)
            details["error"] = {
                "type": error_type_for(self.reason),
                "code": self.reason,
                "retryable": bool(retryable_for(self.reason)),
            }
        metadata: dict[str, Any] = {
            "duplex_event": {"epoch": self.fence.epoch, "turn_id": self.fence.turn_id},
            **(extra or {}),
        }
        return {
            "id": self.response_id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": output,
            "modalities": list(self.modalities),
            "output_modalities": list(self.modalities),
            "metadata": metadata,
        }


def _scoped(response: ActiveResponse) -> dict[str, Any]:
    return {
        "response_id": response.response_id,
        "item_id": response.item_id,
        "output_index": response.output_index,
        "content_index": response.content_index,
    }


def start_events(response: ActiveResponse, previous_item_id: str | None) -> list[DuplexEvent]:
    item = response.item("in_progress", transcript="")
    item["content"] = []
    return [
        DuplexResponseCreated(
            response_id=response.response_id, response=response.response_object("in_progress", [])
        ),
        ConversationItemAdded(previous_item_id=previous_item_id, item=item),
        ConversationItemCreated(previous_item_id=previous_item_id, item=item),
        ResponseOutputItemAdded(
            response_id=response.response_id, output_index=response.output_index, item=item
        ),
    ]


def speak_events(response: ActiveResponse, session_id: str) -> list[DuplexEvent]:
    response.speaking = True
    metadata = {"session_id": session_id, "epoch": response.fence.epoch, "model_speak": True}
    return [
        ResponseSpeak(**_scoped(response), metadata=metadata),
        ResponseContentPartAdded(**_scoped(response), part={"type": "audio", "transcript": ""}),
    ]


def audio_events(
    response: ActiveResponse,
    session_id: str,
    delta_b64: str,
    text: str,
    duration_ms: float,
    end_of_turn: bool,
) -> list[DuplexEvent]:
    """One audio delta and its one transcript delta; updates the ledgers."""
    response.transcript += text
    response.playback.generated_ms += duration_ms
    response.playback.sent_ms = response.playback.generated_ms
    mark = {"text_chars": len(response.transcript), "audio_end_ms": response.playback.generated_ms}
    response.marks.append(mark)
    metadata = {
        "session_id": session_id,
        "epoch": response.fence.epoch,
        "model_speak": True,
        "end_of_turn": end_of_turn,
        "audio_duration_ms": response.playback.generated_ms,
        "audio_text_marks": [mark],
        "playback": response.playback.to_dict(),
    }
    return [
        DuplexOutputAudioDelta(
            **_scoped(response),
            delta=delta_b64,
            format=response.format_name,
            sample_rate_hz=response.encoder.rate,
            metadata=metadata,
        ),
        ResponseOutputAudioTranscriptDelta(**_scoped(response), delta=text),
    ]


def finish_events(
    response: ActiveResponse,
    status: str,
    history_item: dict[str, Any] | None,
    previous_item_id: str | None,
) -> list[DuplexEvent]:
    """The terminal chain. `history_item` is the item as history keeps it (None: removed)."""
    response.status = status
    item_status = "completed" if status == COMPLETED else "incomplete"
    item = history_item or response.item(item_status)
    events: list[DuplexEvent] = []
    if response.speaking:
        part = {"type": "audio", "transcript": response.transcript}
        events += [
            ResponseOutputAudioDone(**_scoped(response)),
            ResponseOutputAudioTranscriptDone(**_scoped(response), transcript=response.transcript),
            ResponseContentPartDone(**_scoped(response), part=part),
        ]
    events += [
        ResponseOutputItemDone(
            response_id=response.response_id, output_index=response.output_index, item=item
        ),
        ConversationItemDone(previous_item_id=previous_item_id, item=item),
        DuplexResponseDone(
            response_id=response.response_id,
            response=response.response_object(
                status,
                [item],
                {
                    "committed": history_item is not None,
                    "playback": response.playback.to_dict(),
                    **response.metrics,
                },
            ),
        ),
        RateLimitsUpdated(rate_limits=[]),
    ]
    return events
