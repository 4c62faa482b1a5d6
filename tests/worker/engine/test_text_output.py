"""`output_modalities: ["text"]` (the session's or a response.create's): the response carries
one text part, GA's events in GA's order, no audio event; its words are the plugin's text,
any audio the stage still makes is dropped, and the plugin is told not to make any.
History, playback acks and checkpoints hold the text. Both surfaces."""

from harness.sessions import appends, make_harness, send_all, sine
from services.worker.engine.checkpoint import export_checkpoint
from shared.contracts import CommittedTurn, ResponseCreateOptions
from shared.protocol.duplex import AckPlayback, Commit, CreateResponse, UpdateSession
from tests.protocol.ga_events import check_ga_event
from tests.worker.engine.test_checkpoint import reimport
from tests.worker.session_parts import RATE, RecordingPort

OPENAI = {"duplex_surface": "openai", "turn_detection": None, "extra_body": {"pace": 0}}
#: a text response on the openai surface, as GA sends it
GA_TEXT_RESPONSE = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "conversation.item.created",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
    "rate_limits.updated",
]
TEXT_END = GA_TEXT_RESPONSE[6:]


async def test_a_text_session_answers_in_text_on_the_openai_surface():
    h = make_harness()
    try:
        session = await h.client.open(OPENAI)
        await session.send(UpdateSession(patch={"type": "realtime", "output_modalities": ["text"]}))
        updated = await session.recv()
        assert updated.session["output_modalities"] == ["text"]
        await send_all(session, appends(sine(24000, 0.2), 24000))
        await session.send(Commit())
        await session.until("input_audio_buffer.committed")
        await session.send(CreateResponse())
        events = await session.until("rate_limits.updated")
    finally:
        await h.manager.shutdown()
    at = [event.wire_type for event in events].index("response.created")
    events = events[at:]
    for event in events:
        check_ga_event(event.to_dict())
    assert [event.wire_type for event in events] == GA_TEXT_RESPONSE
    part_added, delta, text_done, part_done, item_done = events[4:9]
    assert part_added.part == {"type": "text", "text": ""}
    assert (delta.delta, text_done.text) == ("echo 200 ms", "echo 200 ms")
    assert part_done.part == {"type": "text", "text": "echo 200 ms"}
    content = [{"type": "output_text", "text": "echo 200 ms"}]
    assert item_done.item["content"] == content and item_done.item["status"] == "completed"
    done = events[-2].response
    assert done["output_modalities"] == ["text"] and done["output"][0]["content"] == content
    assert all(item_id == delta.item_id for item_id in (part_added.item_id, text_done.item_id))


async def test_a_response_create_asks_for_text_and_the_stages_audio_is_dropped(parts):
    """The duplex surface: contract 1.2's start, a text part (no response.speak)."""
    turn = CommittedTurn(1, "item_user", sine(RATE, 0.5), RATE)
    options = ResponseCreateOptions.from_realtime({"output_modalities": ["text"]})
    await parts.responses.start_response(turn, options, None)
    response = parts.session.active
    await parts.apply(parts.output("audio", 0.1, text="Hello"))
    await parts.apply(parts.output("text", text=" there."))
    await parts.apply(parts.output("audio", 0.1, text=""))  # audio alone: nothing to say
    await parts.apply(parts.output("done"))
    events = parts.take_events()
    assert [event.wire_type for event in events] == [
        "response.created",
        "conversation.item.added",
        "conversation.item.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        *TEXT_END,
    ]
    assert [event.delta for event in events[5:7]] == ["Hello", " there."]
    assert response.playback.generated_ms == 0 and not parts.session.audio_started
    assert response.modalities == ("text",)
    history = parts.session.conversation.get(response.item_id)
    assert history["content"] == [{"type": "output_text", "text": "Hello there."}]
    assert parts.port.plans[-1].payload.speak is False  # echo was told: no audio wanted

    parts.responses.history.acknowledge_playback(AckPlayback(played_ms=0, committed_ms=0))
    acknowledged = parts.take_events()[-1]
    assert acknowledged.event["history_committed"] is True

    restored = reimport(export_checkpoint(parts.session, applied=(0, 0)))
    assert restored.last_response.text_only and restored.last_response.transcript == "Hello there."
    assert restored.conversation.get(response.item_id)["content"][0]["text"] == "Hello there."


async def test_a_cancelled_text_response_keeps_what_it_wrote(parts):
    options = ResponseCreateOptions.from_realtime({"modalities": ["text"]})
    turn = CommittedTurn(1, "item_user", sine(RATE, 0.5), RATE)
    await parts.responses.start_response(turn, options, None)
    response = parts.session.active
    await parts.apply(parts.output("text", text="Half"))
    parts.take_events()
    await parts.responses.advance_epoch("client_cancelled")
    events = parts.take_events()
    assert [event.wire_type for event in events] == TEXT_END
    assert events[0].text == "Half" and events[-2].response["status"] == "cancelled"
    item = parts.session.conversation.get(response.item_id)
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "Half"


async def test_an_openai_text_response_cancelled_before_it_wrote_lists_no_item():
    """No item was announced (the openai surface announces it at the first output), so
    response.done lists none and history holds none."""
    h = make_harness(port=RecordingPort())  # a stage that never answers
    try:
        session = await h.client.open({**OPENAI, "output_modalities": ["text"]})
        await send_all(session, appends(sine(24000, 0.2), 24000))
        await session.send(Commit())
        await session.send(CreateResponse())
        await session.until("response.created")
        await session.send({"type": "response.cancel"})
        events = await session.until("rate_limits.updated")
        state = h.manager.table.runner(session.session_id).session
        assert [item["role"] for item in state.conversation.items] == ["user"]
    finally:
        await h.manager.shutdown()
    for event in events:
        check_ga_event(event.to_dict())
    assert [e.wire_type for e in events] == ["response.done", "rate_limits.updated"]
    assert events[0].response["output"] == [] and events[0].response["status"] == "cancelled"
