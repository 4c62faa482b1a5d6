"""Third-party clients of the native (frame-clocked) surfaces, unchanged, with nothing but
their base URLs (and an API key) pointed at `duplex serve` (see conftest.py for how they run):

- LiveKit's PersonaPlex plugin (`livekit-plugins-nvidia[personaplex]`: its RealtimeModel) on
  the Moshi binary protocol of `/api/chat` (key in the path: the plugin sends no headers),
  against the moshi plugin's PersonaPlex preset on a tiny random checkpoint, one session slot:
  a wrong key is refused, audio and text come back, an interruption ends the generation and the
  next one starts, after `aclose()` a second session gets in (the slot was freed), and each
  session is one stream (a frame back per frame sent), so one generation (one more per
  interruption), as kyutai's moshi.server gives it;
- fujielab's Moshi client (`fujielab-moshi-client`: its MoshiClient) on the same protocol
  against Moshi on a tiny random checkpoint: the handshake, a frame back per frame sent and
  nothing without input, text items that are words only, no warning;
- LiveKit's GPTLiveModel (`livekit-plugins-openai`) and Pipecat's OpenAILiveLLMService on
  OpenAI's GPT-Live protocol of `/v1/live/sessions`, against the echo frame model: the session
  starts, a tone comes back as audio with its transcript, (LiveKit) a session.update and mute /
  unmute are acked and a tone said while muted never comes back, and the close is answered by
  session.closed; no error logged, no warning, every server event valid by Pipecat's models.
"""

from __future__ import annotations

import re

from tests.frameworks.conftest import ECHO_FRAME_MODEL

#: log levels that fail a run
ERROR_LEVELS = {"ERROR", "CRITICAL"}


def records_at(run, levels: set[str], start: int = 0) -> list[dict[str, str]]:
    return [r for r in run["warnings"][start:] if r["level"] in levels]


def test_personaplex_plugin_talks_interrupts_and_frees_its_slot(
    run_native_client, personaplex_serve
):
    run = run_native_client("personaplex_client", personaplex_serve)
    steps = run["steps"]

    # a wrong key: refused on the upgrade (HTTP 4xx), which the plugin does not retry
    refused = steps.get("refused", {}).get("errors", [])
    assert refused and re.search(r"\b4\d\d\b", refused[0]["error"]), run.explain()
    assert not refused[0]["recoverable"], run.explain()
    assert run["failed_step"] is None, run.explain()

    first = steps["first"]
    assert first["handshake"], f"no 0x00 handshake: the plugin sent no audio {run.explain()}"
    assert first["audio_samples"] > 0 and first["text"].strip(), run.explain()
    # the voice as the plugin names it, a `.pt` file of the worker's voice_prompt_dir
    assert first["voice_prompt"] == "NATF2.pt", run.explain()

    interrupt = steps["interrupt"]
    assert interrupt["interrupted"]["ended"], run.explain()
    assert interrupt["next"]["id"] != interrupt["interrupted"]["id"], run.explain()
    assert interrupt["next"]["audio_samples"] > 0, run.explain()

    # one slot: the second session got in once the first had closed
    assert steps["second"]["audio_samples"] > 0, run.explain()

    # one continuous stream per session, as moshi.server gives the plugin: a frame back for
    # every frame sent once the handshake came (the audio the plugin held before it, while
    # the server stepped PersonaPlex's prompt, comes back at most once a frame), and so one
    # generation per session, ended only by the interruption or the microphone's end (the
    # plugin ends a generation after 500 ms without an audio message: max_gap_ms says how
    # near a stall came to it)
    for name, interruptions in (("first_stream", 1), ("second_stream", 0)):
        stream = steps[name]
        after_handshake = stream["frames_sent"] - stream["frames_sent_before_handshake"]
        assert stream["frames_back"] <= stream["frames_sent"], f"{name}: {run.explain()}"
        assert stream["frames_back"] >= int(after_handshake) - 1, f"{name}: {run.explain()}"
        # what the plugin held while the prompt was stepped is heard too, within the worker's
        # 10 s bound on a client-clocked backlog (the prompt takes about 6.5 s here): every
        # frame comes back (less one at most: the model's acoustic delay, which a prompt's
        # steps have already passed)
        if stream["frames_sent_before_handshake"] * 0.08 < 9:
            assert stream["frames_back"] >= stream["frames_sent"] - 1, f"{name}: {run.explain()}"
        assert stream["interruptions"] == interruptions, f"{name}: {run.explain()}"
        assert stream["generations_per"] == "session", f"{name}: {run.explain()}"

    assert not run["errors"], f"error events after the refusal: {run.explain()}"
    after_refusal = run["warnings"][steps["log_records_before_sessions"] :]
    assert not after_refusal, f"the plugin logged: {after_refusal}{run.explain()}"


def test_fujielab_moshi_client_hears_a_frame_per_frame_and_only_words(
    run_native_client, moshi_serve, speech_files
):
    """fujielab's MoshiClient, unchanged, against Moshi on the tiny checkpoint, fed a phrase
    quiet enough that its Ogg writer frames every packet right (under 255 bytes; the client
    picks the level and reports it). What it shows its user is what moshi.server 0.2.13 shows
    it on the same checkpoint and input: 82 frames back for 83 sent, a text item per frame,
    nothing before the client speaks or after it stops, no warning."""
    run = run_native_client(
        "fujielab_client", moshi_serve, "--speech", f"long={speech_files['long']}"
    )
    assert run["failed_step"] is None, run.explain()
    steps = run["steps"]
    assert steps["input"]["largest_packet_bytes"] < 255, run.explain()
    assert steps["connect"]["handshake"], run.explain()

    # the client's audio is the clock: nothing comes before it speaks
    assert steps["quiet"]["frames_back"] == 0 and not steps["quiet"]["texts"], run.explain()
    speak = steps["speak"]
    # a frame back per frame sent, less the model's acoustic delay (one step: moshi's LMGen
    # gives nothing for its first), and no more once the client stops
    assert speak["frames_back"] == speak["frames_sent"] - 1, run.explain()
    assert speak["audio_peak"] > 0, run.explain()
    # its text queue holds words only: no "\x00" (a keepalive's) or blank item
    assert speak["text_items"] > 0 and not speak["bad_texts"], run.explain()
    assert speak["connected"], f"the socket closed while speaking: {run.explain()}"

    assert not steps["disconnect"]["connected"], run.explain()
    assert not run["warnings"], f"the client logged: {run.explain()}"


def assert_clean_live_run(run) -> None:
    assert run["failed_step"] is None, run.explain()
    assert not records_at(run, ERROR_LEVELS), f"errors logged: {run.explain()}"
    assert not run["errors"], f"error events: {run.explain()}"
    assert not run["live_problems"], f"server events Pipecat cannot read: {run.explain()}"
    assert not run["warnings"], f"warnings: {run.explain()}"


def test_livekit_gpt_live_model(run_native_client, echo_frame_serve):
    run = run_native_client("gpt_live_client", echo_frame_serve, "--model", ECHO_FRAME_MODEL)
    assert_clean_live_run(run)
    steps = run["steps"]
    assert steps["started"]["session_id"], run.explain()
    assert steps["update"]["acked"], run.explain()
    assert steps["speak"]["heard"] > 0, run.explain()
    assert steps["speak"]["transcript"].strip(), run.explain()
    assert steps["mute"]["acked"] and steps["unmute"]["acked"], run.explain()
    assert steps["mute"]["heard_while_muted"] == 0, run.explain()
    assert steps["unmute"]["heard"] > 0, run.explain()
    assert run["heard"].get("other", 0) == 0, f"audio that no tone explains: {run.explain()}"
    assert run["transcript"][0]["start_ms"] is not None, run.explain()
    assert run["transcript"][0]["end_ms"] is not None, run.explain()
    close = steps["close"]
    assert close["session_closed"], run.explain()
    assert close["reason"] == "close_requested", run.explain()
    assert run["server_events"].get("session.closed") == 1, run.explain()


def test_pipecat_live_service(run_native_client, echo_frame_serve):
    run = run_native_client("pipecat_live_client", echo_frame_serve, "--model", ECHO_FRAME_MODEL)
    assert_clean_live_run(run)
    steps = run["steps"]
    assert steps["started"]["session_id"], run.explain()
    assert steps["speak"]["heard"] > 0, run.explain()
    assert steps["speak"]["transcript"].strip(), run.explain()
    assert run["heard"].get("other", 0) == 0, f"audio that no tone explains: {run.explain()}"
    close = steps["close"]
    assert close["client_close_sent"] == 1, run.explain()
    assert close["session_closed"], run.explain()
    assert close["reason"] == "close_requested", run.explain()
