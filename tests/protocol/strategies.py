"""Hypothesis strategies for wire messages, derived from the classes' type hints.

Events get values for exactly their declared fields, so a field added to a
class is exercised by the round-trip tests without touching them.
"""

from __future__ import annotations

import base64
import string
import types
import typing
from typing import Any

from hypothesis import strategies as st

from shared.protocol.duplex import (
    INPUT_ENCODINGS,
    TURN_SIGNAL_REMAPS,
    AckPlayback,
    AppendAudio,
    AppendText,
    CancelResponse,
    ClearOutputAudio,
    CloseSession,
    Commit,
    CreateItem,
    CreateResponse,
    DeleteItem,
    DuplexErrorEvent,
    DuplexRawEvent,
    SessionEventAck,
    SessionResume,
    SignalTurn,
    TruncateItem,
    UpdateSession,
    normalize_item,
)
from shared.protocol.realtime.events import ErrorEvent
from shared.protocol.realtime.wire import wire_fields

# orjson refuses lone surrogates (they are not UTF-8), and so does every client.
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
ids = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=24)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | finite_floats | texts
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
json_objects = st.dictionaries(texts, json_values, max_size=4)
non_negative = st.integers(0, 10**9) | st.floats(0, 1e9, allow_nan=False)
optional_event_id = st.none() | ids


def for_hint(hint: Any) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(for_hint(arm) for arm in typing.get_args(hint)))
    if hint is type(None):
        return st.none()
    if (origin or hint) is dict:
        return json_objects
    if (origin or hint) is list:
        return st.lists(json_values, max_size=4)
    return {
        str: texts,
        int: st.integers(-(2**63), 2**63 - 1),
        float: finite_floats,
        bool: st.booleans(),
    }[hint]


def server_event(cls: type) -> st.SearchStrategy[Any]:
    """Instances of one server event class with generated field values."""
    if cls is DuplexRawEvent:
        internal = st.from_regex(r"[a-z][a-z_]{0,10}(\.[a-z_]{1,10}){0,2}", fullmatch=True)
        return st.builds(cls, event_id=ids, internal_type=internal, event=json_objects)
    if issubclass(cls, ErrorEvent):
        common = {
            "event_id": ids,
            "code": st.none() | ids,
            "message": texts,
            "error_type": st.sampled_from(
                ["invalid_request_error", "server_error", "rate_limit_error"]
            ),
            "param": st.none() | texts,
            "related_event_id": st.none() | ids,
        }
        if cls is DuplexErrorEvent:
            reserved = {"type", "code", "message", "param", "event_id", "retryable"}
            extra_keys = texts.filter(lambda k: k not in reserved)
            common["retryable"] = st.none() | st.booleans()
            common["extra"] = st.dictionaries(extra_keys, json_values, max_size=3)
        return st.builds(cls, **common)
    fields = {f.name: for_hint(f.hint) for f in wire_fields(cls)}
    return st.builds(cls, event_id=ids, **fields)


def _item() -> st.SearchStrategy[dict[str, Any]]:
    part = st.fixed_dictionaries({"type": st.just("input_text"), "text": texts})
    message = st.fixed_dictionaries(
        {
            "type": st.just("message"),
            "role": st.just("user"),
            "content": st.lists(part, max_size=3),
        },
        optional={"id": ids},
    )
    call_output = st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": ids, "output": texts}
    )
    return (message | call_output).map(normalize_item)


def _append() -> st.SearchStrategy[AppendAudio]:
    def build(encoding: str) -> st.SearchStrategy[AppendAudio]:
        width = {"pcm16": 2, "pcm_f32le": 4}.get(encoding, 1)
        audio = st.binary(max_size=64).map(lambda b: b[: len(b) - len(b) % width])
        frames = st.lists(
            st.binary(max_size=16).map(lambda b: base64.b64encode(b).decode()), max_size=2
        )
        hint_keys = st.sampled_from(["speech", "speech_probability", "vad", "force_listen", "text"])
        return st.builds(
            AppendAudio,
            event_id=optional_event_id,
            audio=audio,
            format=st.just(encoding),
            sample_rate_hz=st.integers(8_000, 192_000),
            is_speech=st.none() | st.booleans(),
            video_frames=frames.map(tuple),
            duration_ms=st.none() | non_negative,
            audio_end_ms=st.none() | non_negative,
            hints=st.dictionaries(hint_keys, json_values, max_size=3),
        )

    return st.sampled_from(sorted(INPUT_ENCODINGS)).flatmap(build)


def _no_fields(cls: type) -> st.SearchStrategy[Any]:
    return st.builds(cls, event_id=optional_event_id)


def client_command(cls: type) -> st.SearchStrategy[Any]:
    """Valid instances of one client command (or envelope event) class."""
    e = optional_event_id
    table: dict[type, st.SearchStrategy[Any]] = {
        UpdateSession: st.builds(UpdateSession, event_id=e, patch=json_objects),
        ClearOutputAudio: st.builds(ClearOutputAudio, event_id=e, response_id=st.none() | ids),
        CreateResponse: st.builds(CreateResponse, event_id=e, options=json_objects),
        CancelResponse: st.builds(CancelResponse, event_id=e, response_id=st.none() | ids),
        CreateItem: st.builds(
            CreateItem, event_id=e, item=_item(), previous_item_id=st.none() | ids
        ),
        DeleteItem: st.builds(DeleteItem, event_id=e, item_id=ids),
        TruncateItem: st.builds(
            TruncateItem,
            event_id=e,
            item_id=ids,
            content_index=st.integers(0, 8),
            audio_end_ms=non_negative,
        ),
        AppendAudio: _append(),
        Commit: st.builds(
            Commit,
            event_id=e,
            final=st.booleans(),
            create_response=st.none() | st.booleans(),
            is_speech=st.none() | st.booleans(),
        ),
        AppendText: st.builds(AppendText, event_id=e, text=texts),
        SignalTurn: st.builds(
            SignalTurn,
            event_id=e,
            event=texts.filter(lambda t: t not in TURN_SIGNAL_REMAPS),
            payload=json_objects,
        ),
        AckPlayback: st.builds(
            AckPlayback,
            event_id=e,
            played_ms=non_negative,
            committed_ms=st.none() | non_negative,
            response_id=st.none() | ids,
            item_id=st.none() | ids,
            truncate=st.booleans(),
        ),
        CloseSession: st.builds(CloseSession, event_id=e, reason=texts),
        SessionResume: st.builds(
            SessionResume,
            event_id=e,
            session_id=ids,
            resume_token=ids,
            last_received_server_event_seq=st.integers(0, 2**62),
        ),
        SessionEventAck: st.builds(
            SessionEventAck, event_id=e, server_event_seq=st.integers(0, 2**62)
        ),
    }
    return table[cls] if cls in table else _no_fields(cls)
