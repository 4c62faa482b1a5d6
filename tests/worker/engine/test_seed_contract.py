"""Where vLLM-Omni 0.30.0's duplex contract (the seed's; its DuplexClient depends on it)
differs from the contract we read before it, the duplex surface follows 0.30.0: a commit on
an `auto_response` session is answered, session.updated follows session.created, the audio
part opens with the response and `response.speak` comes right before the first audio,
session.closed carries `{type, session_id, reason}`, and the output rate DuplexClient asks
for in `audio.output.sample_rate_hz` is the one sent. The openai surface stays GA's."""

import base64

import pytest

from harness.sessions import appends, make_harness, send_all, sine, types
from shared.protocol.duplex import SURFACE_KEY, SURFACE_OPENAI
from tests.worker.engine.test_echo_turn import RESPONSE_START

AUTO = {"extra_body": {"pace": 0, "auto_response": True}}


@pytest.fixture
async def harness():
    h = make_harness()
    yield h
    await h.manager.shutdown()


async def answered(session, commit: dict) -> list[str]:
    """The event types after `commit`, up to a heartbeat's ack sent once the commit's item
    was done: the runner handles them in order, so a response the commit starts is in."""
    await send_all(session, appends(sine(16000, 0.3), 16000))
    await session.send(commit)
    events = await session.until("conversation.item.done")
    await session.send({"type": "session.heartbeat"})
    events += await session.until("session.heartbeat_ack")
    return types(events)


async def test_a_commit_on_an_auto_response_session_is_answered(harness):
    session = await harness.open(AUTO)
    kinds = await answered(session, {"type": "input_audio_buffer.commit", "final": True})
    assert "response.created" in kinds
    assert "response.done" in types(await session.until("response.done"))


async def test_auto_response_answers_even_a_commit_that_asks_for_none(harness):
    """upstream's barge_in_client commits with `response_create: false` and waits for the
    answer: on an auto_response session the model answers every committed turn"""
    session = await harness.open(AUTO)
    kinds = await answered(session, {"type": "input_audio_buffer.commit", "response_create": False})
    assert "response.created" in kinds


async def test_without_auto_response_said_a_bare_commit_is_not_answered(harness):
    session = await harness.open({"extra_body": {"pace": 0}})
    kinds = await answered(session, {"type": "input_audio_buffer.commit"})
    assert "input_audio_buffer.committed" in kinds and "response.created" not in kinds


async def test_session_updated_follows_session_created_on_the_duplex_surface_only(harness):
    duplex = await harness.manager.open({"extra_body": {"pace": 0}})
    queue = harness.router.queue(duplex.session_id)
    first, second = queue.get_nowait(), queue.get_nowait()
    assert (first.wire_type, second.wire_type) == ("session.created", "session.updated")
    assert second.session == first.session
    openai = await harness.manager.open({SURFACE_KEY: SURFACE_OPENAI})
    queue = harness.router.queue(openai.session_id)
    assert queue.get_nowait().wire_type == "session.created" and queue.empty()


async def test_the_audio_part_opens_with_the_response_and_speak_precedes_the_first_audio(
    harness,
):
    session = await harness.open(AUTO)
    await send_all(session, appends(sine(16000, 0.3), 16000))
    await session.send({"type": "input_audio_buffer.commit"})
    kinds = types(await session.until("response.output_audio.delta"))
    start = kinds[kinds.index("response.created") :]
    # RESPONSE_START ends content_part.added, response.speak
    assert start == [*RESPONSE_START, "response.output_audio.delta"]
    assert RESPONSE_START[-2:] == ["response.content_part.added", "response.speak"]


async def test_session_closed_carries_the_reason_in_its_event(harness):
    session = await harness.open()
    await session.close()
    closed = (await session.until("session.closed"))[-1]
    assert closed.reason == "client_close"
    assert closed.event == {
        "type": "session.closed",
        "session_id": session.session_id,
        "reason": "client_close",
        "cleaned": True,
    }


async def test_the_output_rate_asked_for_in_audio_output_is_the_one_sent(harness):
    """DuplexClient names the encoding in `output_audio_format` and the rate in
    `audio.output.sample_rate_hz`; echo's model speaks at 24 kHz"""
    session = await harness.open(
        {
            **AUTO,
            "output_audio_format": "pcm16",
            "audio": {"output": {"sample_rate_hz": 16000}},
        }
    )
    assert session.session["audio"]["output"]["format"]["rate"] == 16000
    await send_all(session, appends(sine(16000, 1.0), 16000))
    await session.send({"type": "input_audio_buffer.commit"})
    events = await session.until("response.done")
    deltas = [e for e in events if e.wire_type == "response.output_audio.delta"]
    assert {d.sample_rate_hz for d in deltas} == {16000}
    sent = sum(len(base64.b64decode(d.delta)) for d in deltas) // 2  # pcm16 samples
    assert sent == pytest.approx(16000, abs=160)  # echo answers 1 s with 1 s
