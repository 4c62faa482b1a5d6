"""LiveKit Agents, the OpenAI Agents SDK and Pipecat as clients of `duplex serve` on plain
`/v1/realtime` (OpenAI's GA Realtime API), each with its own defaults (the framework's turn
detection: semantic_vad for LiveKit and the Agents SDK, the server's server_vad for Pipecat)
and with manual turns (turn detection off; the framework's commit, reply and interrupt API,
or for Pipecat its local Silero VAD):

- a voice turn gets a spoken reply;
- user speech during the next reply (or the framework's interrupt) ends that reply, cancelled
  with GA's reason (`turn_detected`, `client_cancelled`);
- the turn after it gets its reply;
- a function tool: the user names it, the framework runs it, its output reaches the answer;

with no framework warning or error about an event, and every server event valid by the
openai package's own GA models. See conftest.py for how the clients run.
"""

from __future__ import annotations

import re

import pytest

FRAMEWORKS = ["livekit", "agents", "pipecat"]
MODES = ["defaults", "manual"]
TOOL_NAME = "get_weather"
#: what a framework says when it cannot parse or does not know a server event
EVENT_PROBLEM = re.compile(
    r"validat|unknown|invalid|unexpected|unhandled|failed to handle|not supported|parse",
    re.IGNORECASE,
)


#: warnings a framework gives whatever the server does
BENIGN_WARNING = re.compile(
    # Pipecat, once, whenever server turn detection is off (its manual mode)
    r"is not emitting turn frames"
)
#: errors that are the Realtime API's ordinary answers, which the frameworks expect: Pipecat's
#: manual mode cancels on every start of user speech, a reply or not (OpenAI's code)
BENIGN_ERROR_CODES = {"response_cancel_not_active"}


def assert_no_event_problems(run) -> None:
    warnings = [w for w in run["warnings"] if not BENIGN_WARNING.search(w["message"])]
    about_events = [w for w in warnings if EVENT_PROBLEM.search(w["message"])]
    assert not about_events, f"framework warnings about events: {about_events}{run.explain()}"
    assert not run["ga_problems"], f"server events that are not GA: {run.explain()}"
    errors = [e for e in run["errors"] if not any(code in e for code in BENIGN_ERROR_CODES)]
    assert not errors, f"error events: {errors}{run.explain()}"
    assert not warnings, f"framework warnings: {warnings}{run.explain()}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_voice_turn_interruption_and_next_turn(run_client, framework, mode):
    run = run_client(framework, f"{mode}_turns")
    assert run["failed_step"] is None, run.explain()
    steps = run["steps"]

    turn = steps["turn"]
    assert turn["status"] == "completed", run.explain()
    assert turn["audio_samples"] > 0 and turn["transcript"], run.explain()

    interrupted = steps["interrupt"]
    assert interrupted["id"] != turn["id"]
    reason = "client_cancelled" if mode == "manual" else "turn_detected"
    if framework == "pipecat" and mode == "manual" and interrupted["status"] == "completed":
        # Pipecat's local VAD came after the server had sent the whole reply (a loaded
        # machine): its cancel is refused as OpenAI's is, and it truncates the played item
        assert interrupted["truncated"], run.explain()
    else:
        assert interrupted["status"] == "cancelled", run.explain()
        assert interrupted["reason"] == reason, run.explain()
    assert interrupted["audio_samples"] > 0, f"cut before it spoke: {run.explain()}"

    if mode == "manual":  # turn detection off: the server says nothing of speech
        vad_events = {"input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"}
        assert not vad_events & set(run["server_events"]), run.explain()

    following = steps["next"]
    assert following["id"] not in (turn["id"], interrupted["id"])
    assert following["status"] == "completed", run.explain()
    assert following["audio_samples"] > 0 and following["transcript"], run.explain()
    assert_no_event_problems(run)


def test_pipecat_vad_starts_one_turn_for_each_phrase(pipecat_vad_sweep):
    """Pipecat's manual scenarios above rely on its own VAD making exactly one turn of each
    phrase they say, wherever the server's answers put it: a phrase the VAD misses after some
    silences fails those scenarios by chance, as "thank you" once did."""
    run = pipecat_vad_sweep()
    phrases = run["phrases"]
    assert set(phrases) == {"hello", "long", "thanks", "weather"}, run.explain()
    for name, tally in phrases.items():
        assert tally["offsets"] > 0, run.explain()
        assert tally["missed"] == 0 and tally["split"] == 0, f"{name}: {run.explain()}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_function_tool_round_trip(run_client, framework, mode):
    run = run_client(framework, f"{mode}_tool")
    assert run["failed_step"] is None, run.explain()
    call, answer = run["steps"]["call"], run["steps"]["answer"]
    assert call["status"] == "completed", run.explain()
    assert [c["name"] for c in call["function_calls"]] == [TOOL_NAME], run.explain()
    assert answer["id"] != call["id"]
    assert answer["status"] == "completed", run.explain()
    assert answer["audio_samples"] > 0, run.explain()
    # the tool returned "It is sunny and 21 degrees": the spoken answer uses it
    assert "sunny" in answer["transcript"].lower(), run.explain()
    assert_no_event_problems(run)
