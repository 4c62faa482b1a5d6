"""`max_output_tokens` (the session's or a response.create's; "inf" = none).

On the openai surface (GA): 1-4096; a response's words are counted in tokens (a word is
one token per 4 characters or part of them), the words past the limit are cut, and the
response ends `incomplete` with GA's `status_details: {type: "incomplete", reason:
"max_output_tokens"}`, its item `incomplete`, its stage stopped. On the duplex surface
(as before GA): any positive integer, passed to the model plugin (an LLM's own limit)
and nothing more. A stored config (a checkpoint) is never refused on the range."""

import pytest

from harness.sessions import appends, make_harness, send_all, sine
from plugins.echo import EchoPlugin
from services.worker.engine.checkpoint import (
    export_checkpoint,
    read_checkpoint,
    session_from_checkpoint,
)
from services.worker.engine.handlers import dispatch
from services.worker.engine.lease import LeaseState
from services.worker.engine.response import count_tokens, fit_to_limit
from shared.contracts import CommittedTurn, DuplexSessionError, ResponseCreateOptions
from shared.protocol.duplex import (
    Commit,
    CreateResponse,
    DuplexSessionConfig,
    RealtimeProtocolError,
    UpdateSession,
)
from tests.protocol.ga_events import check_ga_event
from tests.worker.engine.test_echo_turn import RESPONSE_END
from tests.worker.engine.test_tool_calls import recorded_requests
from tests.worker.session_parts import RATE, close_parts, make_parts

OPENAI = {"duplex_surface": "openai", "turn_detection": None, "extra_body": {"pace": 0}}
INCOMPLETE = {"type": "incomplete", "reason": "max_output_tokens"}


@pytest.fixture
async def oparts(parts_for):
    """Session parts on the openai surface (the client commits)."""
    return await parts_for({"duplex_surface": "openai", "turn_detection": None}, EchoPlugin())


@pytest.mark.parametrize(
    "text, tokens",
    [("", 0), ("I", 1), ("hello", 2), ("Hello!", 2), ("Hello! How can I help you?", 7)],
)
def test_tokens_are_counted_per_word(text, tokens):
    assert count_tokens(text) == tokens


@pytest.mark.parametrize(
    "before, piece, limit, kept, over",
    [
        ("", "Hello! How", None, "Hello! How", False),
        ("", "Hello! How", 3, "Hello! How", False),  # exactly at the limit: not over
        ("Hello! How", " can", 3, "", True),
        ("Hello!", " How can", 3, " How", True),
        ("", "Hello", 1, "Hell", True),  # a word longer than a token is cut inside
        ("ec", "ho 50", 1, "ho", True),  # never after a space
    ],
)
def test_fit_to_limit(before, piece, limit, kept, over):
    assert fit_to_limit(before, piece, limit) == (kept, over)


async def start(parts, limit, text_only=False):
    options = {"max_output_tokens": limit}
    if text_only:
        options["output_modalities"] = ["text"]
    turn = CommittedTurn(1, "item_user", sine(RATE, 0.5), RATE)
    openai = parts.session.config.openai_surface
    create = ResponseCreateOptions.from_realtime(options, openai_surface=openai)
    await parts.responses.start_response(turn, create, None)
    parts.take_events()
    return parts.session.active


async def test_an_audio_response_is_cut_at_the_limit_and_its_stage_stopped(oparts):
    parts = oparts
    response = await start(parts, 3)
    epoch = parts.session.epoch
    for text in ("Hello! ", "How can", " I help you?"):
        await parts.apply(parts.output("audio", 0.1, text=text))
    events = parts.take_events()
    deltas = [e.delta for e in events if e.wire_type == "response.output_audio_transcript.delta"]
    # the chunk that went past the limit carries what fits; under a limit a word's trailing
    # space waits for the next word, so the cut response ends at a word
    assert deltas == ["Hello!", " How"]
    assert [e.wire_type for e in events][-len(RESPONSE_END) :] == RESPONSE_END
    done = events[-2].response
    assert (done["status"], done["status_details"]) == ("incomplete", INCOMPLETE)
    assert done["output"][0]["status"] == "incomplete"
    assert done["output"][0]["content"][0]["transcript"] == "Hello! How"
    assert parts.port.aborted == [response.request_id] and parts.session.epoch == epoch + 1
    assert parts.session.conversation.get(response.item_id)["status"] == "incomplete"
    # the stage's outputs after the cut (the third chunk, and any still on their way) are
    # never emitted
    await parts.apply(parts.output("audio", 0.1, text="late", fence=response.fence))
    assert parts.take_events() == [] and parts.responses.dropped_stale_outputs == 2


async def test_a_text_response_is_cut_too(oparts):
    parts = oparts
    await start(parts, 2, text_only=True)
    await parts.apply(parts.output("text", text="Hello! How can I help you?"))
    events = parts.take_events()
    assert [e.delta for e in events if e.wire_type == "response.output_text.delta"] == ["Hello!"]
    text_done = next(e for e in events if e.wire_type == "response.output_text.done")
    assert text_done.text == "Hello!" and events[-2].response["status"] == "incomplete"


async def test_words_that_end_at_the_limit_complete(oparts):
    parts = oparts
    await start(parts, 3)
    await parts.apply(parts.output("audio", 0.1, text="Hello! How "))
    await parts.apply(parts.output("audio", 0.1, text="  "))  # spaces are not past the limit
    await parts.apply(parts.output("done"))
    done = parts.take_events()[-2].response
    assert done["status"] == "completed" and done["status_details"] is None
    assert done["output"][0]["content"][0]["transcript"] == "Hello! How"


async def test_the_response_limit_overrides_the_sessions(oparts):
    parts = oparts
    await dispatch(parts.ctx, UpdateSession(patch={"max_output_tokens": 1}))
    assert parts.session.config.max_tokens == 1
    for options, limit in (
        ({}, 1),
        ({"max_output_tokens": 5}, 5),
        ({"max_output_tokens": "inf"}, None),
    ):
        turn = CommittedTurn(1, "item_user", sine(RATE, 0.5), RATE)
        create = ResponseCreateOptions.from_realtime(options, openai_surface=True)
        await parts.responses.start_response(turn, create, None)
        assert parts.session.active.max_output_tokens == limit
    assert parts.port.plans[-1].payload.transcript == "echo 500 ms"


def test_more_than_4096_is_refused_on_the_openai_surface():
    config = DuplexSessionConfig.from_realtime(
        {"duplex_surface": "openai", "max_output_tokens": 4096}, client=True
    )
    assert config.max_tokens == 4096
    for key in ("max_output_tokens", "max_response_output_tokens"):
        with pytest.raises(RealtimeProtocolError) as info:
            config.apply_update({key: 4097})
        assert info.value.code == "invalid_session_config"
    with pytest.raises(RealtimeProtocolError) as info:
        ResponseCreateOptions.from_realtime({"max_output_tokens": 5000}, openai_surface=True)
    assert (info.value.code, info.value.param) == (
        "invalid_session_config",
        "response.max_output_tokens",
    )


def test_the_duplex_surface_takes_any_positive_limit():
    config = DuplexSessionConfig.from_realtime({"max_output_tokens": 10_000}, client=True)
    assert config.apply_update({"max_tokens": 50_000}).max_tokens == 50_000
    assert ResponseCreateOptions.from_realtime({"max_output_tokens": 10_000}).max_tokens == 10_000
    with pytest.raises(RealtimeProtocolError):
        config.apply_update({"max_output_tokens": 0})  # positive, as before


@pytest.mark.parametrize("surface", [{"duplex_surface": "openai"}, {}])
def test_a_stored_config_is_never_refused_on_the_range(surface):
    """A checkpoint reads its config back without `client` (checkpoint.py): one written by
    a version without GA's bound (a rolling upgrade) restores whatever its limit."""
    stored = DuplexSessionConfig.from_realtime({**surface, "max_tokens": 10_000})
    assert DuplexSessionConfig.from_realtime(stored.to_realtime()).max_tokens == 10_000


async def test_a_duplex_response_is_not_cut_and_its_plugin_gets_the_limit(parts):
    requests = recorded_requests(parts)
    await dispatch(parts.ctx, UpdateSession(patch={"max_output_tokens": 10_000}))
    response = await start(parts, 1)
    assert response.max_output_tokens is None and requests[-1].max_output_tokens == 1
    await parts.apply(parts.output("audio", 0.1, text="Hello! How can I help you?"))
    await parts.apply(parts.output("done"))
    events = parts.take_events()
    done = events[-2].response
    assert done["status"] == "completed" and parts.port.aborted == []
    assert done["output"][0]["content"][0]["transcript"] == "Hello! How can I help you?"
    await start(parts, "inf")
    assert requests[-1].max_output_tokens is None  # "inf": none


async def test_a_duplex_checkpoint_with_a_large_limit_restores():
    parts = await make_parts({"max_output_tokens": 10_000, "extra_body": {"pace": 0}})
    try:
        doc = read_checkpoint(export_checkpoint(parts.session, applied=(0, 0)))
        restored = session_from_checkpoint(
            doc,
            capabilities=parts.session.capabilities,
            lease=LeaseState(None),
            input_rate_hz=16000,
            output_rate_hz=24000,
        )
    finally:
        await close_parts(parts)
    assert restored.config == parts.session.config and restored.config.max_tokens == 10_000


async def test_a_refused_response_create_starts_nothing(oparts):
    bad = CreateResponse(options={"max_output_tokens": 10_000})
    with pytest.raises(RealtimeProtocolError) as info:
        await dispatch(oparts.ctx, bad, in_order=True)
    assert info.value.code == "invalid_session_config" and oparts.take_events() == []


async def test_an_openai_session_opened_over_the_bound_is_refused():
    h = make_harness()
    try:
        with pytest.raises(DuplexSessionError) as info:
            await h.client.open({**OPENAI, "max_output_tokens": 4097})
        assert (info.value.code, info.value.param) == (
            "invalid_session_config",
            "max_output_tokens",
        )
        session = await h.client.open({"max_output_tokens": 10_000})  # the duplex surface
        assert session.session_id
    finally:
        await h.manager.shutdown()


async def test_the_openai_client_sees_a_ga_incomplete_response():
    h = make_harness()  # echo, unpaced: "echo 500 ms" in five chunks
    try:
        session = await h.client.open(OPENAI)
        await send_all(session, appends(sine(24000, 0.5), 24000))
        await session.send(Commit())
        await session.send(CreateResponse(options={"max_output_tokens": 1}))
        events = await session.until("rate_limits.updated")
    finally:
        await h.manager.shutdown()
    for event in events:
        check_ga_event(event.to_dict())
    done = events[-2].response
    assert (done["status"], done["status_details"]) == ("incomplete", INCOMPLETE)
    assert done["max_output_tokens"] == 1  # the limit it ran under, as GA echoes it
    assert done["output"][0]["status"] == "incomplete"
    assert done["output"][0]["content"] == [{"type": "output_audio", "transcript": "echo"}]
    transcript = next(e for e in events if e.wire_type == "response.output_audio_transcript.done")
    assert transcript.transcript == "echo"
