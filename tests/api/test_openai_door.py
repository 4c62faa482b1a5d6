"""The API pod's part of the openai surface (services/api/connection.py): duplex-only
client events told apart. (Its events come without `server_event_seq` from the worker:
tests/redis/test_live_message.py.)"""

import pytest

from services.api.connection import duplex_only
from shared.protocol.duplex import parse_client_event


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
