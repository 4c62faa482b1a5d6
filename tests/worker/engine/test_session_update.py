"""session.update rules and conversation items."""

from harness.sessions import appends, send_all, sine, types
from shared.protocol.duplex import AudioFormat


async def test_update_reconfigures_and_echoes_the_session(harness):
    session = await harness.open({"model": "echo", "extra_body": {"pace": 0}})
    await session.send(
        {
            "type": "session.update",
            "session": {"instructions": "be brief", "input_audio_format": "g711_alaw"},
        }
    )
    updated = await session.recv()
    assert updated.wire_type == "session.updated"
    assert (
        updated.session["instructions"] == "be brief"
        and updated.session["input_audio_format"] == "g711_alaw"
    )
    runner = harness.manager.table.runner(session.session_id)
    assert runner.session.config.input_audio_format == AudioFormat("g711_alaw", 8000)


async def test_update_refusals(harness):
    session = await harness.open({"model": "echo", "voice": "a", "extra_body": {"pace": 0}})
    refusals = {
        "model_update_unsupported": {"model": "other"},
        "ref_audio_update_unsupported": {"ref_audio": "data:audio/wav;base64,AAAA"},
        "unsupported_turn_detection": {"turn_detection": {"type": "turn_vad"}},
        "unsupported_audio_format": {"output_audio_format": "mp3"},
        "invalid_duplex_runtime_config": {"extra_body": {"pace": "fast"}},
    }
    for code, patch in refusals.items():
        await session.send({"type": "session.update", "session": patch, "event_id": code})
        error = await session.recv()
        assert (error.code, error.related_event_id) == (code, code)
        if code == "invalid_duplex_runtime_config":  # the plugin named the field it refused
            assert error.param == "extra_body.pace"
    await session.send({"type": "session.update", "session": {"model": "echo", "voice": "b"}})
    assert (await session.recv()).session["voice"] == "b"  # before any audio the voice may change
    await send_all(session, appends(sine(16000, 0.2), 16000))
    await session.send({"type": "input.commit"})
    await session.until("rate_limits.updated")
    await session.send({"type": "session.update", "session": {"voice": "c"}})
    assert (await session.recv()).code == "voice_update_after_audio_unsupported"


async def test_conversation_items(harness):
    session = await harness.open()
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    await session.send({"type": "conversation.item.create", "item": {**item, "id": "u1"}})
    events = [await session.recv() for _ in range(3)]
    assert types(events) == [
        "conversation.item.added",
        "conversation.item.created",
        "conversation.item.done",
    ]
    assert events[0].previous_item_id is None and events[0].item["object"] == "realtime.item"
    await session.send(
        {"type": "conversation.item.create", "item": {**item, "id": "u0"}, "previous_item_id": "u1"}
    )
    assert (await session.recv()).previous_item_id == "u1"
    await session.until("conversation.item.done")
    await session.send({"type": "response.create", "event_id": "r"})
    error = await session.recv()
    assert (error.code, error.related_event_id) == ("text_only_turn_unsupported", "r")
    await session.send({"type": "response.create"})  # the refusal consumed the items
    assert (await session.recv()).code == "response_create_without_input"
    await session.send({"type": "conversation.item.delete", "item_id": "u1", "event_id": "d"})
    deleted = await session.recv()
    assert deleted.wire_type == "conversation.item.deleted" and deleted.item_id == "u1"
    assert deleted.event["event_id"] == "d"
    for command in (
        {"type": "conversation.item.delete", "item_id": "u1"},
        {"type": "conversation.item.retrieve", "item_id": "u1"},
        {"type": "conversation.item.create", "item": item, "previous_item_id": "nope"},
    ):
        await session.send(command)
        assert (await session.recv()).code == "item_not_found"
    await session.send({"type": "conversation.item.retrieve", "item_id": "u0"})
    assert (await session.recv()).item["content"][0]["text"] == "hi"
    await session.send({"type": "conversation.item.create", "item": {**item, "id": "u0"}})
    assert (await session.recv()).code == "bad_event"  # duplicate id


async def test_turn_signal(harness):
    session = await harness.open()
    await session.send({"type": "turn.signal", "event": "user_started", "payload": {}})
    event = await session.recv()
    assert (event.wire_type, event.event, event.turn_state, event.epoch) == (
        "turn.event",
        "user_started",
        "idle",
        0,
    )
