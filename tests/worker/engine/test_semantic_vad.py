"""semantic_vad: how much silence ends a turn, from the partial transcript's last words and
the eagerness; without a transcript, the eagerness-scaled silence."""

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from harness.sessions import types
from plugins.echo import EchoPlugin
from services.worker.engine.input_pipeline import InputPipeline
from services.worker.engine.semantic_turn import (
    FINISHED,
    PAUSE_PROBE_MS,
    SILENCE_MS,
    UNDECIDED,
    UNFINISHED,
    TurnHint,
    classify,
)
from services.worker.engine.vad import (
    FRAME_MS,
    FRAME_SAMPLES,
    ServerVadDetector,
    VadBackend,
    VadEvent,
    VadStream,
)
from shared.contracts import TurnDetection
from shared.protocol.duplex import AppendAudio, float_to_pcm16
from shared.protocol.duplex.session import SEMANTIC_VAD_SILENCE_MS
from tests.worker.session_parts import LoudnessVad
from tests.worker.transcribing import Recogniser, feed, loud, quiet, settle


def semantic(eagerness: str | None = None) -> TurnDetection:
    settings = {"type": "semantic_vad", "prefix_padding_ms": 0, "min_speech_duration_ms": 64}
    if eagerness is not None:
        settings["eagerness"] = eagerness
    return TurnDetection.from_realtime(settings)


def silence_that_ends(settings: TurnDetection, hint: tuple[str, int] | None = None) -> int:
    """Milliseconds of silence after 320 ms of speech before the detector ends the turn
    (whole 32 ms frames); `hint` (verdict, covers_ms) is handed in when speech ends."""
    detector = ServerVadDetector(LoudnessVad(), settings)
    events = detector.process(np.full(10 * FRAME_SAMPLES, 0.3, np.float32))
    assert events == [VadEvent("started", 0)]
    if hint is not None:
        detector.set_hint(TurnHint(*hint))
    paused = False
    for n in range(1, 400):
        events = detector.process(np.zeros(FRAME_SAMPLES, np.float32))
        if events == [VadEvent("paused", 320)]:  # semantic_vad asks for the words so far
            assert n * FRAME_MS >= PAUSE_PROBE_MS and not paused
            paused = True
        elif events:
            assert events == [VadEvent("stopped", 320)]
            assert paused == (settings.type == "semantic_vad")
            return n * FRAME_MS
    raise AssertionError("the turn never ended")


@pytest.mark.parametrize(
    ("transcript", "verdict"),
    [
        ("Hello there.", FINISHED),
        ("Can you hear me?", FINISHED),
        ("Stop!", FINISHED),
        ('He said "yes."', FINISHED),
        ("I went to the shop and", UNFINISHED),
        ("So I was thinking, um", UNFINISHED),
        ("Well, um.", UNFINISHED),  # a hesitation, even before a full stop
        ("Let me think...", UNFINISHED),
        ("First of all,", UNFINISHED),
        ("hello there", UNDECIDED),  # no punctuation (pocketsphinx): the silence decides
        ("", UNDECIDED),
        (None, UNDECIDED),
    ],
)
def test_the_last_words_say_whether_the_user_finished(transcript, verdict):
    assert classify(transcript) == verdict


def test_a_finished_sentence_ends_the_turn_sooner_than_an_unfinished_one():
    settings = semantic("medium")
    finished = silence_that_ends(settings, (FINISHED, 320))
    undecided = silence_that_ends(settings)
    unfinished = silence_that_ends(settings, (UNFINISHED, 320))
    assert finished < undecided < unfinished
    # the frame (32 ms) that first reaches 400 / 800 / 4000 ms of silence
    assert (finished, undecided, unfinished) == (416, 800, 4000)


EAGERNESS = ("high", "medium", "low")


def test_eagerness_scales_every_verdict():
    for verdict in (FINISHED, UNDECIDED, UNFINISHED):
        hint = None if verdict == UNDECIDED else (verdict, 320)
        high, medium, low = (silence_that_ends(semantic(e), hint) for e in EAGERNESS)
        assert high < medium < low, verdict
    assert silence_that_ends(semantic("auto")) == silence_that_ends(semantic("medium"))
    assert silence_that_ends(semantic()) == silence_that_ends(semantic("medium"))
    # OpenAI's maximum timeouts: 8 s, 4 s, 2 s
    longest = [silence_that_ends(semantic(e), (UNFINISHED, 320)) for e in EAGERNESS]
    assert longest == [2016, 4000, 8000]  # whole frames: the first at or past the limit


def test_a_transcript_of_fewer_words_than_were_said_does_not_count():
    """Decoded before the last speech frame (covers_ms 200 < 320): no verdict."""
    settings = semantic("medium")
    assert silence_that_ends(settings, (FINISHED, 200)) == silence_that_ends(settings)


def test_server_vad_ignores_transcripts_and_never_pauses():
    settings = TurnDetection.from_realtime(
        {"type": "server_vad", "prefix_padding_ms": 0, "min_speech_duration_ms": 64}
    )
    assert silence_that_ends(settings, (UNFINISHED, 320)) == 512  # its silence_duration_ms


class _Held(VadBackend, VadStream):
    """A VAD whose first frame holds until `release`: a conversion that keeps the
    pipeline's lock (a large append: thousands of frames)."""

    def __init__(self) -> None:
        self.inside, self.release = threading.Event(), threading.Event()
        self.released_in_time: bool | None = None

    def new_stream(self) -> VadStream:
        return self

    def probability(self, frame: np.ndarray) -> float:
        if self.released_in_time is None:
            self.inside.set()
            self.released_in_time = self.release.wait(5)  # a failure guard: never hangs
        return 0.0


async def test_a_turn_hint_never_waits_for_a_conversion_in_progress():
    """The runner hands the hint over on the event loop: waiting there for the session's
    conversion on the executor would stall every session of the worker."""
    held = _Held()
    pipeline = InputPipeline(16_000, lambda: held)
    pipeline.configure_vad(semantic("medium"), 0)
    append = AppendAudio(audio=float_to_pcm16(np.zeros(4 * FRAME_SAMPLES, np.float32)),
                         format="pcm16", sample_rate_hz=16_000)  # fmt: skip
    with ThreadPoolExecutor(1) as executor:
        converting = executor.submit(pipeline.convert, append, 0.01)
        assert held.inside.wait(5)  # the conversion holds the lock now
        hint = TurnHint(FINISHED, 320)
        pipeline.set_turn_hint(hint)  # on the loop: returns at once
        held.release.set()
        converting.result(5)
    assert held.released_in_time  # set_turn_hint did not wait for the conversion
    assert pipeline._detector is not None and pipeline._detector.hint is hint


# ---------------------------------------------------------------- through the session


async def turn_end(parts_for, eagerness: str, partial: str | None) -> tuple[int, list]:
    """Speak 600 ms, then feed silence until the turn is committed; returns the silence
    that ended it and the events. The plugin transcribes partials (`partial`), or, with
    None, is a plugin without partial recognition."""
    plugin = Recogniser([partial]) if partial is not None else EchoPlugin()
    td = {"type": "semantic_vad", "eagerness": eagerness, "prefix_padding_ms": 0,
          "min_speech_duration_ms": 64}  # fmt: skip
    parts = await parts_for({"turn_detection": td}, plugin, vad=True)
    await feed(parts, loud(600))
    for step in range(1, 500):
        await feed(parts, quiet(20))
        await settle(parts)
        if "input_audio_buffer.committed" in types(parts.events):
            if isinstance(plugin, Recogniser):  # one decode: asked for at the pause
                assert len(plugin.decoded) == 1  # (no deltas configured: no cadence)
            return step * 20, parts.take_events()
    raise AssertionError("no commit")


async def test_the_partial_transcript_decides_the_end_of_a_spoken_turn(parts_for):
    finished, events = await turn_end(parts_for, "medium", "Hello there.")
    undecided, _ = await turn_end(parts_for, "medium", "hello there")
    unfinished, _ = await turn_end(parts_for, "medium", "Hello there and")
    assert finished < undecided < unfinished
    assert 400 <= finished < 800 <= undecided < 4000 <= unfinished
    # no transcription configured: the partial decided the turn, but was not sent
    assert "conversation.item.input_audio_transcription.delta" not in types(events)
    kinds = types(events)
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index(
        "input_audio_buffer.committed"
    )


async def test_without_partials_the_eagerness_scales_the_silence(parts_for):
    high, _ = await turn_end(parts_for, "high", None)
    medium, _ = await turn_end(parts_for, "medium", None)
    low, _ = await turn_end(parts_for, "low", None)
    assert high < medium < low


ROW = re.compile(r"\| `(\w+)`[^|]* \| ([\d ]+) ms \| ([\d ]+) ms \| ([\d ]+) ms \|")


def test_the_documented_table_is_the_one_the_worker_uses():
    """docs/wire-api.md ("Turn detection") states the silences exactly."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "wire-api.md").read_text()
    rows = {}
    for line in doc.splitlines():
        match = ROW.match(line)
        if match:
            rows[match[1]] = tuple(int(match[i].replace(" ", "")) for i in (2, 3, 4))
    assert set(rows) == {"high", "medium", "low"}
    for eagerness, (finished, undecided, unfinished) in rows.items():
        assert SEMANTIC_VAD_SILENCE_MS[eagerness] == undecided
        assert SILENCE_MS[eagerness] == (finished, unfinished)
    assert SILENCE_MS["auto"] == SILENCE_MS["medium"]
    assert SEMANTIC_VAD_SILENCE_MS["auto"] == SEMANTIC_VAD_SILENCE_MS["medium"]
