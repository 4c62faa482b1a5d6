"""Partial decodes are previews: the worker runs one at a time on a thread of its own and
skips the rest, never holding up VAD or the final transcript; a decode covers at most the
turn's last MAX_PARTIAL_MS; a turn restored mid-speech repeats no delta."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from harness.sessions import appends, send_all, types
from services.worker.control.manager import SessionManager
from services.worker.engine import transcription
from services.worker.engine.checkpoint import (
    export_checkpoint,
    read_checkpoint,
    session_from_checkpoint,
)
from services.worker.engine.lease import LeaseState
from services.worker.engine.transcription import PartialPool
from shared.client.inline import InlineDuplexClient, InlineEventRouter
from shared.contracts import SessionRuntimeConfig
from tests.worker.session_parts import RATE, LoudnessVad
from tests.worker.transcribing import (
    Recogniser,
    feed,
    feed_without_waiting,
    loud,
    of,
    quiet,
    settle,
)

DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
TRANSCRIBED = {"model": "whisper-1"}
VAD = {"type": "server_vad", "prefix_padding_ms": 0, "min_speech_duration_ms": 64,
       "silence_duration_ms": 64, "create_response": False}  # fmt: skip
SEMANTIC = {"type": "semantic_vad", "eagerness": "medium", "prefix_padding_ms": 0,
            "min_speech_duration_ms": 64, "create_response": False}  # fmt: skip
GUARD_S = 5  # failure guards only: a wait that would otherwise hang


class Counting(Recogniser):
    """A recogniser whose partial decodes hold until `gate` opens, counting how many run
    at once."""

    def __init__(self, partials=("one",)) -> None:
        super().__init__(partials)
        self.gate = threading.Event()
        self.running = self.most = 0
        self._lock = threading.Lock()

    def transcribe_partial(self, audio, sample_rate_hz):
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return super().transcribe_partial(audio, sample_rate_hz)
        finally:
            with self._lock:
                self.running -= 1


# ---------------------------------------------------------------- one at a time, skipped


async def test_partials_never_hold_the_executor_and_a_busy_worker_skips_them():
    """One executor thread, three speakers: the first one's decode hangs, yet every
    session's appends are converted (VAD) on that thread and a turn ends with its final
    transcript; the others' decodes were skipped, not queued."""
    plugin = Counting()
    router = InlineEventRouter()
    runtime = SessionRuntimeConfig(max_sessions=4, executor_threads=1)
    manager = SessionManager(plugin, runtime, router, vad_backend=LoudnessVad)
    client = InlineDuplexClient(manager, router)
    config = {"turn_detection": VAD, "input_audio_transcription": TRANSCRIBED,
              "extra_body": {"pace": 0}}  # fmt: skip
    try:
        sessions = [await client.open(config) for _ in range(3)]
        runners = [manager.table.runner(session.session_id) for session in sessions]
        for session, runner in zip(sessions, runners, strict=True):
            await send_all(session, appends(loud(600), RATE))  # a decode is due at 500 ms
            # its appends go through VAD on the executor's one thread
            await asyncio.wait_for(runner.settle_input(), GUARD_S)
        assert [runner.input.partials.decodes for runner in runners] == [1, 0, 0]
        assert [runner.input.partials.in_flight for runner in runners] == [True, False, False]
        assert manager.builder.partial_pool.skipped >= 2
        # the second speaker stops: VAD ends the turn, the final transcript comes
        await send_all(sessions[1], appends(quiet(200), RATE))
        events = await sessions[1].until(COMPLETED, timeout=GUARD_S)
        assert "input_audio_buffer.speech_stopped" in types(events)
        assert events[-1].transcript == "final words"
        assert not plugin.gate.is_set() and plugin.most == 1
    finally:
        plugin.gate.set()
        await manager.shutdown()


async def test_a_skipped_decode_runs_at_the_next_append_once_the_pool_is_free(parts_for):
    plugin = Counting()
    session = {"input_audio_transcription": TRANSCRIBED}
    first, second = await parts_for(session, plugin), await parts_for(session, plugin)
    pool = PartialPool(ThreadPoolExecutor(1, thread_name_prefix="test-partials"))
    first.input.partials.pool = second.input.partials.pool = pool
    try:
        await feed_without_waiting(first, loud(500))  # its decode holds the pool
        assert first.input.partials.in_flight
        await feed(second, loud(540))  # due at 500 ms: skipped at 500, 520 and 540 ms
        assert pool.skipped == 3
        assert second.input.partials.decodes == 0 and not second.input.partials.in_flight
        plugin.gate.set()
        await settle(first)
        await feed(second, loud(20))  # the next append: the skipped decode runs now
        assert second.input.partials.decodes == 1
        assert plugin.decoded == [RATE // 2, RATE * 560 // 1000] and plugin.most == 1
    finally:
        plugin.gate.set()
        pool.executor.shutdown(wait=True)


async def test_a_pause_skipped_while_the_pool_is_busy_is_decoded_while_it_lasts(parts_for):
    """semantic_vad: the pause's decode is retried at the next append; its transcript
    (a finished sentence) still ends the turn sooner than the silence alone would."""
    plugin = Counting(["Hello there."])
    first = await parts_for({"input_audio_transcription": TRANSCRIBED}, plugin)
    second = await parts_for({"turn_detection": SEMANTIC}, plugin, vad=True)
    pool = PartialPool(ThreadPoolExecutor(1, thread_name_prefix="test-partials"))
    first.input.partials.pool = second.input.partials.pool = pool
    try:
        await feed_without_waiting(first, loud(500))
        await feed(second, loud(600))
        await feed(second, quiet(200))  # the pause (160 ms): its decode is skipped
        assert second.input.partials.decodes == 0 and pool.skipped >= 1
        plugin.gate.set()
        await settle(first)
        silence_ms = 200
        while "input_audio_buffer.committed" not in types(second.events):
            assert silence_ms < 2000, "the turn never ended"
            await feed(second, quiet(20))
            silence_ms += 20
        assert second.input.partials.decodes == 1
        # FINISHED at medium eagerness: 400 ms of silence, against 800 undecided
        assert silence_ms < 800
    finally:
        plugin.gate.set()
        pool.executor.shutdown(wait=True)


# ---------------------------------------------------------------- the turn's last 30 s


async def test_a_partial_decodes_at_most_the_turns_last_max_partial_ms(parts_for, monkeypatch):
    """Past the cap, cadence decodes (deltas) stop and a pause decodes the turn's end
    only; such a partial sends no delta (deltas start at the turn's first word)."""
    monkeypatch.setattr(transcription, "MAX_PARTIAL_MS", 1000)
    plugin = Recogniser(["one", "one two", "one two three"])
    parts = await parts_for(
        {"turn_detection": SEMANTIC, "input_audio_transcription": TRANSCRIBED}, plugin, vad=True
    )
    await feed(parts, loud(1500))
    assert plugin.decoded == [RATE // 2, RATE]  # no cadence decode past 1000 ms
    await feed(parts, quiet(200))  # the pause: the turn's last 1000 ms only
    assert plugin.decoded == [RATE // 2, RATE, RATE]
    await settle(parts)
    assert [d.delta for d in of(parts.take_events(), DELTA)] == ["one"]


# ---------------------------------------------------------------- a drain mid-speech


async def test_a_turn_restored_mid_speech_repeats_no_delta(parts_for):
    """The old worker sent "one"; the new one does not know it: it sends no delta for the
    item, whose `.completed` carries the transcript. The next turn streams again."""
    session = {"input_audio_transcription": TRANSCRIBED}
    old = await parts_for(session, Recogniser(["one", "one two"]))
    await feed(old, loud(1000))
    assert [d.delta for d in of(old.take_events(), DELTA)] == ["one"]
    item_id = old.session.input.item_id
    doc = read_checkpoint(export_checkpoint(old.session, applied=(1, 50), with_input=True))
    plugin = Recogniser(["one two three", "one two three four"])
    state = session_from_checkpoint(
        doc,
        capabilities=plugin.capabilities(4),
        lease=LeaseState(None),
        input_rate_hz=RATE,
        output_rate_hz=plugin.output_sample_rate_hz,
    )
    new = await parts_for(session, plugin, state=state)
    await feed(new, loud(1000))
    new.commit(create_response=False)
    await settle(new)
    events = new.take_events()
    assert of(events, DELTA) == []
    assert [(e.item_id, e.transcript) for e in of(events, COMPLETED)] == [(item_id, "final words")]
    await feed(new, loud(1000))  # the next turn is this worker's own
    deltas = of(new.take_events(), DELTA)
    assert [d.delta for d in deltas] == ["one two three"]  # its first two partials agree
    assert {d.item_id for d in deltas} == {new.session.input.item_id} != {item_id}
