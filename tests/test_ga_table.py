"""docs/wire-api.md's GA tables place every event and field of OpenAI's Realtime GA API.

The names come from the installed `openai` SDK's types (the unions of server and client
events, the session and response.create models), so an SDK that grows a GA event or
field fails here until the table says what we do with it. What the table claims is
checked against our codec: an event marked sent needs a class of ours, one marked not
sent must have none (the openai surface forwards what the worker emits).
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from openai.types.realtime import (
    realtime_audio_config_input,
    realtime_audio_config_output,
    realtime_client_event,
    realtime_response_create_params,
    realtime_server_event,
    realtime_session_create_request,
)

from shared.protocol.duplex import CLIENT_COMMAND_TYPES, ENVELOPE_EVENT_TYPES, SERVER_EVENT_TYPES

DOC = Path(__file__).resolve().parents[1] / "docs" / "wire-api.md"
VALUES = {"sent", "not sent", "accepted", "used", "echoed", "ignored"}


def table(marker: str) -> dict[str, tuple[str, str]]:
    """The rows after `<!-- marker -->`: name -> (openai surface, duplex surface)."""
    text = DOC.read_text()
    start = text.index(f"<!-- {marker} -->")
    rows: dict[str, tuple[str, str]] = {}
    for line in text[start:].splitlines()[3:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        name = re.fullmatch(r"`([^`]+)`", cells[0])
        assert name, f"not a `name` cell: {line}"
        assert name.group(1) not in rows, f"{name.group(1)} is listed twice"
        assert {cells[1], cells[2]} <= VALUES, f"unknown value in: {line}"
        rows[name.group(1)] = (cells[1], cells[2])
    return rows


def union_types(union: object) -> set[str]:
    """The `type` literals of a discriminated union of pydantic models."""
    if typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    names = set()
    for model in typing.get_args(union):
        (literal,) = typing.get_args(model.model_fields["type"].annotation)
        names.add(literal)
    return names


def test_every_ga_server_event_is_placed_and_what_we_send_exists():
    rows = table("GA server events")
    assert set(rows) == union_types(realtime_server_event.RealtimeServerEvent)
    for name, (openai, duplex) in rows.items():
        if "sent" in (openai, duplex) and name != "error":
            assert name in SERVER_EVENT_TYPES, f"{name} is marked sent but has no class"
        if openai == duplex == "not sent":
            assert name not in SERVER_EVENT_TYPES, f"{name} has a class: is it sent?"


def test_every_ga_client_event_is_placed_and_accepted_ones_parse():
    rows = table("GA client events")
    assert set(rows) == union_types(realtime_client_event.RealtimeClientEvent)
    known = set(CLIENT_COMMAND_TYPES) | set(ENVELOPE_EVENT_TYPES)
    for name, (openai, duplex) in rows.items():
        assert openai == duplex == "accepted", name
        assert name in known, f"{name} is marked accepted but nothing parses it"


@pytest.mark.parametrize(
    "marker, fields",
    [
        (
            "GA session fields",
            set(realtime_session_create_request.RealtimeSessionCreateRequest.model_fields)
            - {"audio"}
            | {
                f"audio.input.{f}"
                for f in realtime_audio_config_input.RealtimeAudioConfigInput.model_fields
            }
            | {
                f"audio.output.{f}"
                for f in realtime_audio_config_output.RealtimeAudioConfigOutput.model_fields
            },
        ),
        (
            "GA response.create fields",
            set(realtime_response_create_params.RealtimeResponseCreateParams.model_fields),
        ),
    ],
)
def test_every_ga_field_is_placed(marker, fields):
    assert set(table(marker)) == fields
