"""One response's state and the events of its canonical sequence (contract 1.2).

start:   response.created, then the message item (`item_events`):
         conversation.item.added -> conversation.item.created -> response.output_item.added
         (the openai surface: output_item.added first, GA's order, and only once the
         response has something to say: `ActiveResponse.announced`, module end)
part:    audio: response.speak -> response.content_part.added{audio}  (before the first audio)
         text:  response.content_part.added{text}                     (before the first text)
audio:   response.output_audio.delta + response.output_audio_transcript.delta
text:    response.output_text.delta
finish:  audio: response.output_audio.done -> response.output_audio_transcript.done
         text:  response.output_text.done
         -> response.content_part.done -> response.output_item.done
         -> conversation.item.done -> response.done -> rate_limits.updated
The finish chain closes only what was opened, so a response cancelled before
its first audio ends with output_item.done -> conversation.item.done ->
response.done -> rate_limits.updated (on the openai surface, whose item was never
announced, with response.done -> rate_limits.updated alone).

A text response (its modalities without "audio": `output_modalities: ["text"]`) carries
one `output_text` part instead of audio; its words are `transcript` all the same.

`max_output_tokens` (the openai surface; a duplex response has no limit here): a
response's words are counted in tokens (`count_tokens`: a word, a run of non-space
characters, is one token per 4 characters or part of them), and `fit_to_limit` cuts the
words that would go past the limit (docs/wire-api.md).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from services.worker.engine.ledgers import PlaybackLedger
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
    ResponseOutputTextDelta,
    ResponseOutputTextDone,
    ResponseSpeak,
    error_type_for,
    retryable_for,
)

COMPLETED, CANCELLED, FAILED, INCOMPLETE = "completed", "cancelled", "failed", "incomplete"
#: the reason of a response cut at its max_output_tokens (GA's)
MAX_OUTPUT_TOKENS = "max_output_tokens"
#: characters of a word per counted token (`count_tokens`)
CHARS_PER_TOKEN = 4


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
    #: the content part (audio or text) is open: at the start of an audio response on the
    #: duplex surface, else at its first output
    speaking: bool = False
    #: its first output was sent (on the duplex surface `response.speak` right before it,
    #: after the content part)
    spoke: bool = False
    #: the response's words: the audio's transcript, or a text response's text
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
    #: the message item was announced (output_item.added) and is in history; the duplex
    #: surface announces it at the start, the openai surface at the first output, so a
    #: response that only calls a tool has no empty message item (GA)
    announced: bool = False
    #: the limit on the response's words in tokens (None: none; always on the duplex
    #: surface, whose limit only reaches the plugin)
    max_output_tokens: int | None = None
    #: under a limit, the spaces that end the words so far, sent with the next words:
    #: a response cut at its limit ends at a word, not at a space (`take_words`)
    held_space: str = ""

    @property
    def item_id(self) -> str:
        return "item_" + self.response_id

    @property
    def format_name(self) -> str:
        return self.encoder.format.encoding

    @property
    def text_only(self) -> bool:
        """A text response: `output_text` content, no audio."""
        return "audio" not in self.modalities

    def committed_text(self, committed_ms: float) -> str:
        """The transcript up to `committed_ms` of audio, from the audio/text marks."""
        chars = 0
        for mark in self.marks:
            if mark["audio_end_ms"] <= committed_ms + 1e-6:
                chars = int(mark["text_chars"])
        return self.transcript[:chars]

    def item(self, status: str, transcript: str | None = None) -> dict[str, Any]:
        said = self.transcript if transcript is None else transcript
        part = (
            {"type": "output_text", "text": said}
            if self.text_only
            else {"type": "output_audio", "transcript": said}
        )
        return {
            "id": self.item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part],
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


# ---------------------------------------------------------------- max_output_tokens


def count_tokens(text: str) -> int:
    """`text` in tokens: each word (a run of non-space characters) counts one token per
    `CHARS_PER_TOKEN` characters or part of them ("I" 1, "hello" 2, "Hello!" 2)."""
    return sum(-(-len(word) // CHARS_PER_TOKEN) for word in text.split())


def fit_to_limit(before: str, piece: str, limit: int | None) -> tuple[str, bool]:
    """The part of `piece` that keeps `before + piece` within `limit` tokens, and whether
    anything of `piece` was cut. The cut falls at a token boundary: after the last whole
    token that fits (a word longer than a token may be cut inside), never after a space."""
    if limit is None or count_tokens(before + piece) <= limit:
        return piece, False
    low, high = 0, len(piece)  # count_tokens grows with the prefix: bisect the longest fit
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens(before + piece[:middle]) <= limit:
            low = middle
        else:
            high = middle - 1
    return piece[:low].rstrip(), True


def take_words(response: ActiveResponse, text: str) -> tuple[str, bool]:
    """The words of a stage output the response may say under its max_output_tokens, and
    whether they reached past it (the response then ends `incomplete`). Under a limit the
    spaces that end them wait for the next words, so a cut response ends at a word."""
    if response.max_output_tokens is None:
        return text, False
    kept, over = fit_to_limit(
        response.transcript, response.held_space + text, response.max_output_tokens
    )
    if over:
        response.held_space = ""
        return kept, True
    words = kept.rstrip()
    response.held_space = kept[len(words) :]
    return words, False


# ---------------------------------------------------------------- events


def _scoped(response: ActiveResponse) -> dict[str, Any]:
    return {
        "response_id": response.response_id,
        "item_id": response.item_id,
        "output_index": response.output_index,
        "content_index": response.content_index,
    }


def created_event(response: ActiveResponse) -> DuplexEvent:
    return DuplexResponseCreated(
        response_id=response.response_id, response=response.response_object("in_progress", [])
    )


def item_events(
    response: ActiveResponse, previous_item_id: str | None, *, ga_order: bool
) -> list[DuplexEvent]:
    """The message item is announced: it entered history after `previous_item_id`."""
    response.announced = True
    item = response.item("in_progress", transcript="")
    item["content"] = []
    added = ResponseOutputItemAdded(
        response_id=response.response_id, output_index=response.output_index, item=item
    )
    conversation: list[DuplexEvent] = [
        ConversationItemAdded(previous_item_id=previous_item_id, item=item),
        ConversationItemCreated(previous_item_id=previous_item_id, item=item),
    ]
    return [added, *conversation] if ga_order else [*conversation, added]


def part_events(response: ActiveResponse) -> list[DuplexEvent]:
    """The content part opens: an audio part, or a text part for a text response. On the
    duplex surface an audio part opens with the response, as vLLM-Omni 0.30.0 does (its
    clients check `content_part.added`, `response.speak`, `output_audio.delta`); on the
    openai surface, and for a text part, at the first output."""
    response.speaking = True
    if response.text_only:
        part: dict[str, str] = {"type": "text", "text": ""}
    else:
        part = {"type": "audio", "transcript": ""}
    return [ResponseContentPartAdded(**_scoped(response), part=part)]


def speak_event(response: ActiveResponse, session_id: str) -> DuplexEvent:
    """`response.speak`: the model chose to speak (duplex surface, audio responses)."""
    metadata = {"session_id": session_id, "epoch": response.fence.epoch, "model_speak": True}
    return ResponseSpeak(**_scoped(response), metadata=metadata)


def audio_events(
    response: ActiveResponse,
    session_id: str,
    delta_b64: str,
    text: str,
    duration_ms: float,
    end_of_turn: bool,
    *,
    ga: bool = False,
) -> list[DuplexEvent]:
    """One audio delta and its one transcript delta; updates the ledgers. `ga`: the
    openai surface's delta, built as GA has it (no metadata built only to be dropped)."""
    response.transcript += text
    response.playback.generated_ms += duration_ms
    response.playback.sent_ms = response.playback.generated_ms
    mark = {"text_chars": len(response.transcript), "audio_end_ms": response.playback.generated_ms}
    response.marks.append(mark)
    transcript = ResponseOutputAudioTranscriptDelta(**_scoped(response), delta=text)
    if ga:
        # GA's delta, built directly: no metadata built only for surface.py to drop
        return [DuplexOutputAudioDelta(**_scoped(response), delta=delta_b64), transcript]
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
        transcript,
    ]


def text_events(response: ActiveResponse, text: str) -> list[DuplexEvent]:
    """Words without audio: a text response's text delta, or, in an audio response, a
    transcript delta alone (the model wrote them without sound: echo's answer to a text
    turn). The mark keeps them in history at the audio generated so far."""
    response.transcript += text
    if response.text_only:
        return [ResponseOutputTextDelta(**_scoped(response), delta=text)]
    mark = {"text_chars": len(response.transcript), "audio_end_ms": response.playback.generated_ms}
    response.marks.append(mark)
    return [ResponseOutputAudioTranscriptDelta(**_scoped(response), delta=text)]


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
    said = response.transcript
    if response.speaking and response.text_only:
        events += [
            ResponseOutputTextDone(**_scoped(response), text=said),
            ResponseContentPartDone(**_scoped(response), part={"type": "text", "text": said}),
        ]
    elif response.speaking:
        if response.spoke:  # an audio part opened with the response may close unused
            events += [
                ResponseOutputAudioDone(**_scoped(response)),
                ResponseOutputAudioTranscriptDone(**_scoped(response), transcript=said),
            ]
        events.append(
            ResponseContentPartDone(**_scoped(response), part={"type": "audio", "transcript": said})
        )
    if response.announced:
        events += [
            ResponseOutputItemDone(
                response_id=response.response_id, output_index=response.output_index, item=item
            ),
            ConversationItemDone(previous_item_id=previous_item_id, item=item),
        ]
    events += [
        DuplexResponseDone(
            response_id=response.response_id,
            response=response.response_object(
                status,
                [item] if response.announced else [],
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
