"""Playback acks, truncation, and what enters history under both commit policies."""

import math

import pytest

from harness.sessions import appends, make_harness, send_all, sine


async def echo_turn(session, seconds: float = 1.0):
    """A completed echo response; returns (response_id, item_id, transcript)."""
    await send_all(session, appends(sine(16000, seconds), 16000))
    await session.send({"type": "input.commit"})
    events = await session.until("rate_limits.updated")
    done = events[-2]
    return done.response_id, done.response["output"][0]["id"], done.response["output"][0]


async def retrieve(session, item_id):
    await session.send({"type": "conversation.item.retrieve", "item_id": item_id})
    return (await session.until("conversation.item.retrieved"))[-1].item


@pytest.fixture
async def harness_pair():
    h = make_harness()
    yield h
    await h.manager.shutdown()


async def test_commit_all_on_done_puts_the_whole_transcript_in_history(harness_pair):
    session = await harness_pair.open()
    response_id, item_id, item = await echo_turn(session)
    assert item["content"][0]["transcript"] == "echo 1000 ms" and item["status"] == "completed"
    await session.send({"type": "playback.ack", "response_id": response_id, "played_ms": 300})
    ack = (await session.until("playback.acknowledged"))[-1].event
    assert ack["played_ms"] == 300 and ack["committed_ms"] == pytest.approx(1000)
    # a boolean, as vLLM-Omni 0.30.0 has it (its harness checks `is True`); the words are
    # the item's, and playback.acknowledged names its own type inside `event`
    assert ack["history_committed"] is True and ack["type"] == "playback.acknowledged"
    assert (await retrieve(session, item_id))["content"][0]["transcript"] == "echo 1000 ms"


async def test_ack_only_history_grows_with_acknowledged_playback(harness_pair):
    session = await harness_pair.open(
        {"playback_commit_policy": "ack_only", "extra_body": {"pace": 0}}
    )
    response_id, item_id, item = await echo_turn(session)
    assert item["content"][0]["transcript"] == ""  # nothing played yet
    transcripts = []
    for played in (300, 200, 1000):  # acks are monotonic: 200 after 300 changes nothing
        await session.send({"type": "playback.ack", "played_ms": played})
        ack = (await session.until("playback.acknowledged"))[-1].event
        assert ack["history_committed"] is True
        assert ack["response_id"] == response_id and ack["item_id"] == item_id
        transcripts.append((await retrieve(session, item_id))["content"][0]["transcript"])
    assert transcripts[0] == transcripts[1] == "echo 1000 ms"[: len(transcripts[0])]
    assert 0 < len(transcripts[0]) < len("echo 1000 ms")
    assert transcripts[2] == "echo 1000 ms"


async def test_truncate_ack_keeps_only_what_was_heard(harness_pair):
    session = await harness_pair.open()
    _, item_id, _ = await echo_turn(session)
    await session.send({"type": "playback.ack", "played_ms": 500, "truncate": True})
    ack = (await session.until("playback.acknowledged"))[-1].event
    assert ack["truncate"] is True and ack["committed_ms"] == 500
    assert ack["history_committed"] is True
    heard = (await retrieve(session, item_id))["content"][0]["transcript"]
    assert "echo 1000 ms".startswith(heard) and 0 < len(heard) < len("echo 1000 ms")


async def test_conversation_item_truncate(harness_pair):
    session = await harness_pair.open()
    _, item_id, _ = await echo_turn(session)
    await session.send(
        {
            "type": "conversation.item.truncate",
            "item_id": item_id,
            "audio_end_ms": 200,
            "event_id": "t",
        }
    )
    truncated = (await session.until("conversation.item.truncated"))[-1]
    assert (truncated.item_id, truncated.audio_end_ms, truncated.content_index) == (item_id, 200, 0)
    assert truncated.event["event_id"] == "t"
    text = (await retrieve(session, item_id))["content"][0]["transcript"]
    assert "echo 1000 ms".startswith(text) and len(text) < 5
    await session.send(
        {"type": "conversation.item.truncate", "item_id": item_id, "audio_end_ms": 5000}
    )
    assert (await session.recv()).code == "bad_event"
    await session.send(
        {"type": "conversation.item.truncate", "item_id": "item_nope", "audio_end_ms": 1}
    )
    assert (await session.recv()).code == "item_not_found"


async def test_truncate_accepts_the_length_rounded_up_to_a_whole_millisecond(harness_pair):
    """audio_end_ms is whole ms; an item of 780.8 ms takes 781 (the Agents SDK's clamp)."""
    session = await harness_pair.open()
    await send_all(session, appends(sine(16000, 0.7808), 16000))
    await session.send({"type": "input.commit"})
    done = (await session.until("rate_limits.updated"))[-2]
    item_id = done.response["output"][0]["id"]
    await session.send({"type": "playback.ack", "played_ms": 0})
    generated = (await session.until("playback.acknowledged"))[-1].event["playback"]
    generated_ms = generated["generated_ms"]
    assert generated_ms != int(generated_ms)  # the case: a fractional length
    whole = math.ceil(generated_ms)
    await session.send(
        {"type": "conversation.item.truncate", "item_id": item_id, "audio_end_ms": whole + 1}
    )
    assert (await session.recv()).code == "bad_event"
    await session.send(
        {"type": "conversation.item.truncate", "item_id": item_id, "audio_end_ms": whole}
    )
    truncated = (await session.until("conversation.item.truncated"))[-1]
    assert truncated.audio_end_ms == whole
    # nothing was cut: history keeps the whole transcript
    item = await retrieve(session, item_id)
    assert (
        item["content"][0]["transcript"] == done.response["output"][0]["content"][0]["transcript"]
    )


async def test_cancel_keeps_the_played_prefix():
    h = make_harness()
    try:
        session = await h.open({"extra_body": {"pace": 1}})
        await send_all(session, appends(sine(16000, 2.0), 16000))
        await session.send({"type": "input.commit"})
        events = await session.until("response.output_audio.delta")
        item_id = next(e for e in events if e.wire_type == "response.output_item.added").item["id"]
        await session.until("response.output_audio.delta")
        await session.send({"type": "playback.ack", "played_ms": 100})
        await session.until("playback.acknowledged")
        await session.send({"type": "response.cancel"})
        done = next(
            e for e in await session.until("response.done") if e.wire_type == "response.done"
        )
        item = done.response["output"][0]
        assert item["status"] == "incomplete"
        kept = item["content"][0]["transcript"]
        assert "echo 2000 ms".startswith(kept) and len(kept) < len("echo 2000 ms")
        assert done.response["metadata"]["playback"]["committed_ms"] == 100
        assert (await retrieve(session, item_id))["content"][0]["transcript"] == kept
    finally:
        await h.manager.shutdown()


async def test_ack_errors(harness_pair):
    session = await harness_pair.open()
    await session.send({"type": "playback.ack", "played_ms": 10, "event_id": "a"})
    error = await session.recv()
    assert (error.code, error.related_event_id) == ("playback_item_not_found", "a")
    response_id, _, _ = await echo_turn(session)
    await session.send({"type": "playback.ack", "played_ms": 10, "item_id": "item_other"})
    assert (await session.recv()).code == "playback_item_mismatch"
    await session.send({"type": "playback.ack", "played_ms": 10, "response_id": "resp_unknown"})
    assert (await session.recv()).code == "playback_item_not_found"
    await session.send({"type": "playback.ack", "played_ms": 10, "response_id": response_id})
    assert (await session.recv()).wire_type == "playback.acknowledged"
