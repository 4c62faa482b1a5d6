"""parse -> render -> parse is the identity for every event and command type."""

import re

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol.duplex import (
    CLIENT_COMMAND_TYPES,
    ENVELOPE_EVENT_TYPES,
    SERVER_EVENT_TYPES,
    ConversationItemRetrieve,
    parse_client_event,
    parse_server_event,
)
from tests.protocol.strategies import client_command, server_event

EVENT_ID = re.compile(r"^event_[0-9a-f]{32}$")


@pytest.mark.parametrize("wire_type", sorted(SERVER_EVENT_TYPES))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_server_event_roundtrip(wire_type, data):
    cls = SERVER_EVENT_TYPES[wire_type]
    event = data.draw(server_event(cls))
    rendered = event.to_json()
    decoded = orjson.loads(rendered)
    assert decoded["type"] == event.wire_type
    assert list(decoded)[:2] == ["type", "event_id"]
    again = parse_server_event(decoded)
    assert type(again) is cls
    assert again == event
    assert again.to_json() == rendered  # rendering is deterministic: compact, same key order


@pytest.mark.parametrize("wire_type", sorted(SERVER_EVENT_TYPES))
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_server_events_get_a_fresh_event_id_and_render_compactly(wire_type, data):
    example = data.draw(server_event(SERVER_EVENT_TYPES[wire_type]))
    fields = {k: v for k, v in vars(example).items() if k != "event_id"}
    first, second = type(example)(**fields), type(example)(**fields)
    assert EVENT_ID.match(first.event_id) and first.event_id != second.event_id
    rendered = first.to_json()
    assert rendered == orjson.dumps(orjson.loads(rendered))  # no insignificant whitespace


@pytest.mark.parametrize("wire_type", sorted(CLIENT_COMMAND_TYPES))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_client_command_roundtrip(wire_type, data):
    cls = CLIENT_COMMAND_TYPES[wire_type]
    command = data.draw(client_command(cls))
    rendered = command.to_json()
    again = parse_client_event(rendered)
    assert type(again) is cls
    assert again == command
    assert parse_client_event(again.to_json()) == command


@pytest.mark.parametrize("wire_type", ["session.resume", "session.event_ack"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_envelope_event_roundtrip(wire_type, data):
    event = data.draw(client_command(ENVELOPE_EVENT_TYPES[wire_type]))
    assert parse_client_event(event.to_json()) == event


def test_retrieve_becomes_signal_turn_and_roundtrips_as_one():
    command = parse_client_event(
        b'{"type":"conversation.item.retrieve","item_id":"item_1","event_id":"c1"}'
    )
    assert command.wire_type == "turn.signal"
    assert (command.event, command.payload, command.event_id) == (
        "conversation.item.retrieve",
        {"item_id": "item_1"},
        "c1",
    )
    assert parse_client_event(command.to_json()) == command
    assert ConversationItemRetrieve(item_id="item_1", event_id="c1").to_command() == command
