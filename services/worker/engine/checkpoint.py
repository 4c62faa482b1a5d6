"""A session's checkpoint: everything of an `EngineSession` that outlives one response, as
compact JSON (readable with redis-cli: `GET duplex:session:{SID}:checkpoint`).

Keys: `v` (1), `session_id`, `config` (the session config in realtime form, its whole
`extra_body` included; `duplex_surface` for a session of another surface than the duplex
one: "openai", "moshi" or "live"),
`runtime_config`, `items` (the conversation), `epoch`, `turn_id`, `turn_state`,
`input_generation`, `unanswered_items`, `audio_started`, `overlap_reported`,
`surface_state` (what Moshi's and GPT-Live's surfaces keep: `started`, `muted`,
`usage_reported_ms`; native_surfaces.py), `last_response_id`, `responses` (the retained
responses: id, item id, stage request id, fence, playback ledger, transcript, audio/text
marks, modalities, output format, status, the client's metadata, whether its message item
was announced, its max_output_tokens),
`active` (the in-flight response, or null), `pending_turns`
(committed turns not answered yet, audio base64 float32 at the model's input rate),
`input_stream_samples` (the session's input clock, so server-VAD timestamps go on where
they were), `applied` ([attachment, seq]:
the highest command mark whose whole effect is in the checkpoint), `model_state` (the
plugin's `export_session_state`, or null) and `input` (a drain's final checkpoint only:
the uncommitted turn's audio, base64 float32, its text and the input ledger's timing;
null otherwise, and always null for a model-native session, whose model heard that audio).

A model-native session's model state is not in the checkpoint: it is its model history
(`duplex:session:{SID}:model`, appended in the same fenced calls; native_stream.py),
read back beside the checkpoint at a restore.

Function calls: `function_call` and `function_call_output` items are items like any other;
the calls still waiting for an output are the call items without one
(`Conversation.pending_call_ids`), so `items` carries them and an output sent after a move
is accepted. A response's calls not emitted yet (it had not completed) are not carried:
a restore fails an in-flight response, and its calls with it (tool_calls.py).

Audio in conversation items: none is kept. Items the engine makes never hold audio (a
user turn's item has its transcript; its audio lives in the pending turn until answered);
a client's `conversation.item.create` may carry inline `audio` in a content part, and the
checkpoint drops that field, keeping the transcript: a restored session's items are
transcripts only, and `conversation.item.retrieve` after a move returns them that way.

What is not carried: the input pipeline's resampler and VAD state (a restored session's
VAD starts afresh at the input clock), the output encoder's resampler state (only an
in-flight response has any, and a restore fails that response), input work in flight, and
the idle lease's clock (a restored session's idle TTL starts at the restore).
"""

from __future__ import annotations

import base64
import collections
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from services.worker.engine.command_marks import Mark
from services.worker.engine.conversation import Conversation
from services.worker.engine.engine_session import EngineSession
from services.worker.engine.lease import LeaseState
from services.worker.engine.ledgers import InputLedger, PlaybackLedger
from services.worker.engine.response import ActiveResponse
from services.worker.engine.surface_state import NativeSurfaceState
from shared.contracts import (
    CommittedTurn,
    DuplexCapabilities,
    DuplexFence,
    DuplexSessionConfig,
    DuplexSessionError,
)
from shared.protocol.duplex import AudioFormat, OutputAudioEncoder
from shared.protocol.duplex.errors import WORKER_LOST

VERSION = 1


class CheckpointError(DuplexSessionError):
    """A checkpoint that cannot be read (code `worker_lost`: the session cannot go on)."""

    def __init__(self, message: str) -> None:
        super().__init__(WORKER_LOST, f"unreadable checkpoint: {message}")


# ---------------------------------------------------------------- export


def export_checkpoint(
    session: EngineSession,
    *,
    applied: Mark,
    model_state: Mapping[str, Any] | None = None,
    with_input: bool = False,
) -> bytes:
    """The session's checkpoint JSON; `with_input`: a drain's final one, which carries
    the uncommitted turn (its audio and timing)."""
    return orjson.dumps(checkpoint_document(session, applied, model_state, with_input))


def checkpoint_document(
    session: EngineSession,
    applied: Mark,
    model_state: Mapping[str, Any] | None,
    with_input: bool,
) -> dict[str, Any]:
    return {
        "v": VERSION,
        "session_id": session.session_id,
        "config": {**session.config.to_realtime(), "extra_body": dict(session.config.extra_body)},
        "runtime_config": session.runtime_config,
        "items": [_without_audio(item) for item in session.conversation.items],
        "epoch": session.epoch,
        "turn_id": session.turn_id,
        "turn_state": session.turn_state,
        "input_generation": session.input_generation,
        "unanswered_items": session.unanswered_items,
        "audio_started": session.audio_started,
        "overlap_reported": session.overlap_reported,
        "surface_state": session.surface_state.to_dict(),
        "last_response_id": session.last_response.response_id if session.last_response else None,
        "responses": [_response(r) for r in session.responses.values()],
        "active": _response(session.active) if session.active is not None else None,
        "pending_turns": [_turn(turn) for turn in session.pending_turns],
        "input_stream_samples": session.input.stream_samples,
        "applied": list(applied if with_input else before_turn(applied, session.input)),
        "model_state": model_state,
        "input": _input(session.input) if with_input else None,
    }


def _without_audio(item: Mapping[str, Any]) -> dict[str, Any]:
    content = item.get("content")
    if not isinstance(content, list) or not any(
        isinstance(part, Mapping) and "audio" in part for part in content
    ):
        return dict(item)
    parts = [
        {k: v for k, v in part.items() if k != "audio"} if isinstance(part, Mapping) else part
        for part in content
    ]
    return {**item, "content": parts}


def _response(response: ActiveResponse) -> dict[str, Any]:
    fmt = response.encoder.format
    return {
        "id": response.response_id,
        "item_id": response.item_id,
        "request_id": response.request_id,
        "fence": [response.fence.epoch, response.fence.turn_id],
        "format": {"encoding": fmt.encoding, "rate": fmt.rate},
        "modalities": list(response.modalities),
        "output_index": response.output_index,
        "content_index": response.content_index,
        "speaking": response.speaking,
        "spoke": response.spoke,
        "transcript": response.transcript,
        "marks": response.marks,
        "playback": response.playback.to_dict(),
        "status": response.status,
        "reason": response.reason,
        "metrics": response.metrics,
        "metadata": response.metadata,
        "announced": response.announced,
        "max_output_tokens": response.max_output_tokens,
    }


def _turn(turn: CommittedTurn) -> dict[str, Any]:
    return {
        "turn_id": turn.turn_id,
        "item_id": turn.item_id,
        "audio": encode_samples(turn.audio),
        "sample_rate_hz": turn.sample_rate_hz,
        "text": turn.text,
        "transcript": turn.transcript,
    }


def _input(ledger: InputLedger) -> dict[str, Any]:
    return {
        "audio": encode_samples(ledger.peek()),
        "sample_rate_hz": ledger.sample_rate_hz,
        "text": ledger.text,
        "speech_started_ms": ledger.speech_started_ms,
        "speech_stopped": ledger.speech_stopped,
        "item_id": ledger.item_id,
        "stream_samples": ledger.stream_samples,
        "first_mark": list(ledger.first_mark) if ledger.first_mark else None,
    }


def before_turn(applied: Mark, ledger: InputLedger) -> Mark:
    """`applied` for a checkpoint without the uncommitted turn's audio: before the turn's
    first append (its audio is not in the checkpoint, so neither is that command)."""
    if ledger.first_mark is None or ledger.first_mark > applied:
        return applied
    attachment, seq = ledger.first_mark
    return (attachment, seq - 1)


def encode_samples(samples: np.ndarray) -> str:
    return base64.b64encode(np.asarray(samples, "<f4").tobytes()).decode("ascii")


def decode_samples(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), "<f4").astype(np.float32)


# ---------------------------------------------------------------- import


def read_checkpoint(data: bytes | str) -> dict[str, Any]:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(doc, dict) or doc.get("v") != VERSION:
        raise CheckpointError(f"version {doc.get('v') if isinstance(doc, dict) else None!r}")
    return doc


def applied_mark(doc: Mapping[str, Any]) -> Mark:
    attachment, seq = doc.get("applied") or (0, 0)
    return int(attachment), int(seq)


def session_from_checkpoint(
    doc: Mapping[str, Any],
    *,
    capabilities: DuplexCapabilities,
    lease: LeaseState,
    input_rate_hz: int,
    output_rate_hz: int,
) -> EngineSession:
    """The `EngineSession` a checkpoint describes (no input work in flight)."""
    try:
        return _session(doc, capabilities, lease, input_rate_hz, output_rate_hz)
    except DuplexSessionError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{type(exc).__name__}: {exc}") from None


def _session(
    doc: Mapping[str, Any],
    capabilities: DuplexCapabilities,
    lease: LeaseState,
    input_rate_hz: int,
    output_rate_hz: int,
) -> EngineSession:
    session_id = doc["session_id"]
    config_doc = dict(doc["config"])
    extra_body = config_doc.get("extra_body") or {}
    config = DuplexSessionConfig.from_realtime(config_doc)
    config = DuplexSessionConfig(**{**_fields(config), "extra_body": dict(extra_body)})
    session = EngineSession(
        session_id=session_id,
        config=config,
        runtime_config=dict(doc["runtime_config"]),
        capabilities=capabilities,
        lease=lease,
        input=InputLedger(input_rate_hz),
    )
    conversation = Conversation()
    for item in doc["items"]:
        conversation.add(dict(item))
    session.conversation = conversation
    session.epoch = int(doc["epoch"])
    session.turn_id = int(doc["turn_id"])
    session.turn_state = doc["turn_state"]
    session.input_generation = int(doc["input_generation"])
    session.unanswered_items = int(doc["unanswered_items"])
    session.audio_started = bool(doc.get("audio_started", False))
    session.overlap_reported = doc.get("overlap_reported")
    session.surface_state = NativeSurfaceState.from_dict(doc.get("surface_state"))
    responses = collections.OrderedDict()
    for entry in doc["responses"]:
        response = _active(session_id, entry, output_rate_hz)
        responses[response.response_id] = response
    session.responses = responses
    active = doc.get("active")
    if active is not None:
        session.active = responses.get(active["id"]) or _active(session_id, active, output_rate_hz)
    last = doc.get("last_response_id")
    session.last_response = responses.get(last) if last else None
    session.pending_turns = collections.deque(
        CommittedTurn(
            int(t["turn_id"]),
            t["item_id"],
            decode_samples(t["audio"]),
            int(t["sample_rate_hz"]),
            t.get("text", ""),
            t.get("transcript"),
        )
        for t in doc["pending_turns"]
    )
    session.input.stream_samples = int(doc.get("input_stream_samples", 0))
    _restore_input(session.input, doc.get("input"))
    return session


def _fields(config: DuplexSessionConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def _active(session_id: str, entry: Mapping[str, Any], output_rate_hz: int) -> ActiveResponse:
    fmt = entry["format"]
    epoch, turn_id = entry["fence"]
    response = ActiveResponse(
        response_id=entry["id"],
        fence=DuplexFence(session_id, int(epoch), int(turn_id)),
        request_id=entry["request_id"],
        encoder=OutputAudioEncoder(AudioFormat(fmt["encoding"], fmt["rate"]), output_rate_hz),
        modalities=tuple(entry["modalities"]),
        output_index=int(entry["output_index"]),
        content_index=int(entry["content_index"]),
        speaking=bool(entry["speaking"]),
        # a checkpoint written before `spoke` existed opened its part with response.speak
        spoke=bool(entry.get("spoke", entry["speaking"])),
        transcript=entry["transcript"],
        marks=[dict(mark) for mark in entry["marks"]],
        playback=PlaybackLedger(**entry["playback"]),
        status=entry["status"],
        reason=entry.get("reason"),
        metrics=dict(entry.get("metrics") or {}),
        metadata=entry.get("metadata"),
        # a checkpoint of before the openai surface's lazy item announced it at the start
        announced=bool(entry.get("announced", True)),
        max_output_tokens=entry.get("max_output_tokens"),
    )
    return response


def _restore_input(ledger: InputLedger, saved: Mapping[str, Any] | None) -> None:
    """A drain's uncommitted turn back into the ledger, its timing as it was."""
    if not saved:
        return
    audio = decode_samples(saved["audio"])
    if int(saved["sample_rate_hz"]) != ledger.sample_rate_hz:
        raise CheckpointError(
            f"input audio at {saved['sample_rate_hz']} Hz, this model takes "
            f"{ledger.sample_rate_hz} Hz"
        )
    ledger.append(audio)
    ledger.stream_samples = int(saved["stream_samples"])
    ledger.text = saved.get("text", "")
    ledger.speech_started_ms = saved.get("speech_started_ms")
    ledger.speech_stopped = bool(saved.get("speech_stopped", False))
    ledger.item_id = saved.get("item_id")
    first_mark = saved.get("first_mark")
    ledger.first_mark = (int(first_mark[0]), int(first_mark[1])) if first_mark else None
