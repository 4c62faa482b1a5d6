"""The registries hold exactly the contract's vocabulary (reference-contract.md 1.2-1.3)."""

from shared.protocol import duplex, realtime
from shared.protocol.duplex import (
    CLIENT_COMMAND_TIERS,
    CLIENT_COMMAND_TYPES,
    CLIENT_EVENT_ALIASES,
    ENVELOPE_EVENT_TYPES,
    SERVER_EVENT_TIERS,
    SERVER_EVENT_TYPES,
)

TIER1_EVENTS = {
    "session.updated",
    "input_audio_buffer.speech_started",
    "input_audio_buffer.speech_stopped",
    "input_audio_buffer.cleared",
    "conversation.item.added",
    "conversation.item.created",
    "conversation.item.done",
    "conversation.item.retrieved",
    "conversation.item.input_audio_transcription.completed",
    "conversation.item.input_audio_transcription.delta",
    "conversation.item.input_audio_transcription.failed",
    "input_audio_buffer.timeout_triggered",
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.content_part.done",
    "response.output_audio.done",
    "response.output_audio_transcript.delta",
    "response.output_audio_transcript.done",
    "response.output_text.delta",
    "response.output_text.done",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "rate_limits.updated",
    "output_audio_buffer.cleared",
}
TIER2_EVENTS = {
    "session.created",
    "response.created",
    "response.done",
    "response.output_audio.delta",
    "input_audio_buffer.committed",
    "conversation.item.deleted",
    "conversation.item.truncated",
    "error",
}
TIER3_EVENTS = {
    "session.heartbeat_ack",
    "session.closed",
    "session.expired",
    "session.resumed",
    "session.replaced",
    "session.resync_required",
    "response.speak",
    "response.listen",
    "overlap.decision",
    "playback.acknowledged",
    "turn.event",
    "duplex.<type>",
}
TIER1_COMMANDS = {
    "session.update",
    "input_audio_buffer.clear",
    "output_audio_buffer.clear",
    "response.create",
    "response.cancel",
    "conversation.item.create",
    "conversation.item.delete",
    "conversation.item.truncate",
}
TIER2_COMMANDS = {"input_audio_buffer.append", "input_audio_buffer.commit"}
TIER3_COMMANDS = {
    "input.text.append",
    "input.cancel",
    "barge_in",
    "turn.signal",
    "playback.ack",
    "session.heartbeat",
    "session.close",
}


def test_server_events_are_exactly_the_contracts_45():
    assert len(TIER1_EVENTS) == 25 and len(TIER2_EVENTS) == 8 and len(TIER3_EVENTS) == 12
    assert set(SERVER_EVENT_TYPES) == TIER1_EVENTS | TIER2_EVENTS | TIER3_EVENTS
    assert len(SERVER_EVENT_TYPES) == 45
    for tier, expected in ((1, TIER1_EVENTS), (2, TIER2_EVENTS), (3, TIER3_EVENTS)):
        assert {t for t, n in SERVER_EVENT_TIERS.items() if n == tier} == expected


def test_client_commands_are_exactly_the_contracts_17():
    assert len(TIER1_COMMANDS) == 8 and len(TIER2_COMMANDS) == 2 and len(TIER3_COMMANDS) == 7
    assert set(CLIENT_COMMAND_TYPES) == TIER1_COMMANDS | TIER2_COMMANDS | TIER3_COMMANDS
    assert len(CLIENT_COMMAND_TYPES) == 17
    for tier, expected in ((1, TIER1_COMMANDS), (2, TIER2_COMMANDS), (3, TIER3_COMMANDS)):
        assert {t for t, n in CLIENT_COMMAND_TIERS.items() if n == tier} == expected


def test_envelope_only_events_and_aliases():
    assert set(ENVELOPE_EVENT_TYPES) == {
        "session.resume",
        "session.event_ack",
        "conversation.item.retrieve",
    }
    assert not set(ENVELOPE_EVENT_TYPES) & set(CLIENT_COMMAND_TYPES)
    assert CLIENT_EVENT_ALIASES == {
        "input.commit": "input_audio_buffer.commit",
        "audio.playback_ack": "playback.ack",
        "close": "session.close",
        "close_session": "session.close",
        "input_text.append": "input.text.append",
        "push_text": "input.text.append",
        "signal_turn": "turn.signal",
    }
    assert set(CLIENT_EVENT_ALIASES.values()) <= set(CLIENT_COMMAND_TYPES)


def test_openai_half_holds_33_events_and_10_commands():
    assert set(realtime.REALTIME_SERVER_EVENTS) == TIER1_EVENTS | TIER2_EVENTS
    assert set(realtime.REALTIME_CLIENT_COMMANDS) == TIER1_COMMANDS | TIER2_COMMANDS


def test_tier1_is_reexported_and_tier2_subclasses_its_openai_twin():
    for wire_type in TIER1_EVENTS:
        assert SERVER_EVENT_TYPES[wire_type] is realtime.REALTIME_SERVER_EVENTS[wire_type]
    for wire_type in TIER2_EVENTS:
        ours, theirs = SERVER_EVENT_TYPES[wire_type], realtime.REALTIME_SERVER_EVENTS[wire_type]
        assert ours is not theirs and issubclass(ours, theirs)
    for wire_type in TIER1_COMMANDS:
        assert CLIENT_COMMAND_TYPES[wire_type] is realtime.REALTIME_CLIENT_COMMANDS[wire_type]
    for wire_type in TIER2_COMMANDS:
        ours, theirs = CLIENT_COMMAND_TYPES[wire_type], realtime.REALTIME_CLIENT_COMMANDS[wire_type]
        assert ours is not theirs and issubclass(ours, theirs)


def test_tier2_classes_declare_only_additive_fields():
    """A Tier 2 class keeps every OpenAI field of its twin, so OpenAI clients still parse it."""
    from shared.protocol.realtime.wire import wire_fields

    for wire_type in TIER2_EVENTS - {"error"}:
        ours, theirs = SERVER_EVENT_TYPES[wire_type], realtime.REALTIME_SERVER_EVENTS[wire_type]
        base = [f.name for f in wire_fields(theirs)]
        assert [f.name for f in wire_fields(ours)][: len(base)] == base
        assert all(not f.required for f in wire_fields(ours)[len(base) :]), wire_type


def test_the_door_exports_what_it_documents():
    for name in duplex.__all__:
        assert hasattr(duplex, name), name
