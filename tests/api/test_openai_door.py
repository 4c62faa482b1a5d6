"""The API pod's part of the openai surface (services/api/connection.py): the journal's
seq cut off what is sent, duplex-only client events told apart."""

import orjson
import pytest

from services.api.connection import duplex_only, without_seq
from shared.protocol.duplex import parse_client_event


@pytest.mark.parametrize(
    "event",
    [
        {"type": "rate_limits.updated", "event_id": "e", "rate_limits": []},
        {"type": "error", "event_id": "e", "error": {"message": 'a "server_event_seq":1}'}},
    ],
)
def test_the_seq_the_journal_appends_is_cut_off(event):
    plain = orjson.dumps(event)
    journaled = plain[:-1] + b',"server_event_seq":12345}'  # what event_publish.lua writes
    assert without_seq(journaled) == plain
    assert without_seq(plain) == plain  # session.created and unjournaled events: as they are


@pytest.mark.parametrize(
    "frame, refused",
    [
        ({"type": "session.heartbeat"}, True),
        ({"type": "playback.ack", "played_ms": 10}, True),
        ({"type": "input.cancel"}, True),
        ({"type": "session.close"}, True),
        ({"type": "close"}, True),  # an alias of a Tier 3 command
        ({"type": "turn.signal", "event": "user_started"}, True),
        ({"type": "session.event_ack", "server_event_seq": 1}, True),
        ({"type": "session.resume", "session_id": "s", "resume_token": "t"}, True),
        ({"type": "conversation.item.retrieve", "item_id": "item_1"}, False),  # GA's
        ({"type": "response.cancel"}, False),
        ({"type": "input_audio_buffer.commit"}, False),
        ({"type": "output_audio_buffer.clear"}, False),
        ({"type": "session.update", "session": {"type": "realtime"}}, False),
    ],
)
def test_duplex_only_client_events(frame, refused):
    assert duplex_only(parse_client_event(frame)) is refused
