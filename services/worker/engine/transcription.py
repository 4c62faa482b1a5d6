"""Input transcription: partial transcripts while the user speaks, and the transcript
events of a committed item.

Who gets which event (docs/wire-api.md, "Input transcription"). "Configured" means the
session object set `audio.input.transcription` (GA) or `input_audio_transcription`
(beta) to an object; setting it to null turns transcription events off.

- `conversation.item.input_audio_transcription.completed` / `.failed`: for every committed
  item with audio, from the plugin's recogniser (`transcribe`), when transcription is
  configured; on the duplex surface also when it is not mentioned at all (the model's own
  recogniser reports, as it always has there). `.failed` replaces `.completed` when the
  recogniser raised: the item is committed without a transcript and the session goes on.
- `...delta`: only when configured and the plugin `transcribes_partials`.

Partial decodes (`PartialTranscriber`): while the user speaks (between speech_started and
the commit; in a session without turn detection, from the first speech of the turn to its
commit), each time the turn has `CADENCE_MS` more audio than at the previous decode, the
plugin's `transcribe_partial` runs with the turn so far; never two at once per session (a
decode that outlasts the cadence delays the next). semantic_vad asks for one more at each
pause (`on_pause`), for its end-of-turn verdict, whether or not deltas are configured. The
result comes back through the runner's mailbox and is applied on its task; one whose turn
has ended (commit, clear, cancel, a new speech start) is dropped there, so a stale
partial is never emitted.

Partials are previews, so they never crowd out the work that cannot wait (`PartialPool`):
the worker runs them on its own thread, one at a time across all its sessions, never on
the executor that converts appends (VAD) and transcribes committed turns. A decode asked
for while that thread is busy is skipped, not queued: the session asks again at its next
append (a pause's decode too, while the pause lasts); semantic_vad without a fresh
transcript waits the eagerness-scaled silence. A decode covers at most the turn's last
`MAX_PARTIAL_MS`: deltas stop once a turn is longer (they must start at its first word),
pauses are still decoded for semantic_vad; `.completed` transcribes the whole turn.

Deltas are incremental and never retracted (`StableWords`): a word is sent once two
consecutive partials agree on it and on every word before it (a partial cut mid-word
guesses its last word). A partial that revises a word already sent sends nothing; deltas
resume once two consecutive partials again begin with the words sent and agree past them.
`.completed` carries the final transcript, which may differ from the deltas joined. A
turn already under way when the session was built (restored from a drain's checkpoint)
sends no deltas: the words the old worker sent are not known here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from typing import Any

from services.worker.engine.engine_session import EngineSession
from services.worker.engine.input_queue import start_task
from shared.contracts import DuplexModelPlugin, DuplexSessionConfig
from shared.protocol.duplex import (
    SEMANTIC_VAD,
    DuplexEvent,
    InputAudioTranscriptionCompleted,
    InputAudioTranscriptionDelta,
    InputAudioTranscriptionFailed,
)

log = logging.getLogger(__name__)

#: new audio in the turn between two partial decodes
CADENCE_MS = 500
#: the most audio one partial decode takes: the turn's last 30 s (one Whisper window)
MAX_PARTIAL_MS = 30_000
#: `.failed`'s error code
TRANSCRIPTION_FAILED = "transcription_failed"


# ---------------------------------------------------------------- what the session asked for


def transcription_setting(config: DuplexSessionConfig) -> tuple[bool, Any]:
    """(declared?, value) of the session's transcription setting: GA's
    `audio.input.transcription` first, else beta's `input_audio_transcription`."""
    extra = config.extra_body
    audio = extra.get("realtime_audio")
    nested = audio.get("input") if isinstance(audio, Mapping) else None
    if isinstance(nested, Mapping) and "transcription" in nested:
        return True, nested["transcription"]
    if "realtime_input_audio_transcription" in extra:
        return True, extra["realtime_input_audio_transcription"]
    return False, None


def reports_transcripts(config: DuplexSessionConfig) -> bool:
    """Whether `.completed` / `.failed` are sent (module docstring)."""
    declared, value = transcription_setting(config)
    return value is not None if declared else not config.openai_surface


def streams_transcripts(config: DuplexSessionConfig) -> bool:
    """Whether `.delta` is sent (the plugin must also transcribe partials)."""
    declared, value = transcription_setting(config)
    return declared and value is not None


def is_semantic(config: DuplexSessionConfig) -> bool:
    td = config.turn_detection
    return td is not None and td.type == SEMANTIC_VAD


def transcript_events(
    config: DuplexSessionConfig,
    item_id: str,
    transcript: str | None,
    failure: BaseException | None,
    audio_s: float,
) -> list[DuplexEvent]:
    """The transcript event of a committed item: `.completed`, `.failed` or none."""
    if not reports_transcripts(config):
        return []
    if failure is not None:
        error = {
            "type": "server_error",
            "code": TRANSCRIPTION_FAILED,
            "message": f"speech recognition failed: {failure}"[:500],
        }
        return [InputAudioTranscriptionFailed(item_id=item_id, content_index=0, error=error)]
    if transcript is None:
        return []
    usage = {"type": "duration", "seconds": round(audio_s, 3)}
    return [
        InputAudioTranscriptionCompleted(
            item_id=item_id, content_index=0, transcript=transcript, usage=usage
        )
    ]


# ---------------------------------------------------------------- stable words


_NORMAL = re.compile(r"[^\w']+")


class StableWords:
    """The words of one item already sent as deltas (module docstring)."""

    def __init__(self, *, closed: bool = False) -> None:
        self.sent: list[str] = []  # normalised: lower case, punctuation stripped
        self.previous: list[tuple[str, str]] | None = None  # (normalised, as written)
        self.closed = closed  # no more deltas for the item

    def update(self, text: str) -> str | None:
        """The delta a new partial makes stable, or None."""
        if self.closed:
            return None
        words = [(norm, raw) for raw in text.split() if (norm := _NORMAL.sub("", raw.lower()))]
        previous, self.previous = self.previous, words
        if previous is None:
            return None
        agreed = 0
        while agreed < min(len(previous), len(words)) and previous[agreed][0] == words[agreed][0]:
            agreed += 1
        sent = len(self.sent)
        if agreed <= sent or [norm for norm, _ in words[:sent]] != self.sent:
            return None  # nothing new, or a revision of what was sent: never retracted
        new = words[sent:agreed]
        self.sent += [norm for norm, _ in new]
        return (" " if sent else "") + " ".join(raw for _, raw in new)


# ---------------------------------------------------------------- partial decodes


class PartialPool:
    """Where partial decodes run: `executor`, at most `limit` at a time across every
    transcriber that shares the pool (the worker's: `SessionManager`). A decode that finds
    every slot busy is skipped, not queued; a slot is given back when the decode's thread
    is done with it, not when the task awaiting it is cancelled."""

    def __init__(self, executor: Executor, limit: int = 1) -> None:
        self.executor = executor
        self.limit = limit
        self.skipped = 0  # decodes refused while the pool was busy, for tests and metrics
        self._free = threading.Semaphore(limit)

    def reserve(self) -> bool:
        """Take a slot for a decode (then `submit` it), or False: skipped, all are busy."""
        if self._free.acquire(blocking=False):
            return True
        self.skipped += 1
        return False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any] | None:
        """Run `fn(*args)` in the slot `reserve` took; None when the executor is shut
        down (the worker is stopping)."""
        try:
            future = self.executor.submit(fn, *args)
        except RuntimeError:
            self._free.release()
            return None
        future.add_done_callback(lambda _: self._free.release())
        return future


@dataclasses.dataclass
class PartialTranscript:
    """A partial decode's result, for the runner's mailbox. `covers_ms`: the stream time
    the decoded audio reached; `text` None when the decode failed (logged); `whole`: the
    decode started at the turn's first sample (not cut to `MAX_PARTIAL_MS`)."""

    token: int
    item_id: str
    text: str | None
    covers_ms: int
    whole: bool = True


class PartialTranscriber:
    """One session's partial decodes. Every method but the decode itself runs on the
    runner's task (the single-writer invariant of `runner.py`). `executor`: where decodes
    run, one at a time, unless a shared `pool` is set (the runner sets the worker's)."""

    def __init__(
        self,
        session: EngineSession,
        plugin: DuplexModelPlugin,
        executor: Executor,
        deliver: Callable[[Any], None],
        emit: Callable[[DuplexEvent], None],
    ) -> None:
        self.session = session
        self.plugin = plugin
        self.pool = PartialPool(executor)
        self.deliver = deliver
        self.emit = emit
        self.token = 0  # bumped when the turn ends: a result of an older token is stale
        self.in_flight = False
        self.decodes = 0  # started, for tests and metrics
        self._task: asyncio.Task[None] | None = None
        #: a pause asked for a decode while one was running, or the busy pool skipped it
        self._urgent = False
        self._decoded_samples = 0  # the turn's length at the last decode
        # the turn the state here belongs to; one already under way (a drain's checkpoint
        # restored) sends no deltas: the old worker's are not known (module docstring)
        self._item_id: str | None = session.input.item_id
        self._words = StableWords(closed=self._item_id is not None)

    # ------------------------------------------------------------ turn boundaries

    def reset(self) -> None:
        """The turn ended or restarted: what is in flight is stale, deltas start over.
        A decode still running keeps `in_flight` until its (dropped) result is applied."""
        self.token += 1
        self._urgent = False
        self._decoded_samples = 0
        self._words = StableWords()

    async def stop(self) -> None:
        task, self._task = self._task, None
        self.token += 1
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    # ------------------------------------------------------------ triggers

    def on_audio(self) -> None:
        """Audio was added to the turn: decode if the cadence is due (deltas stop past
        `MAX_PARTIAL_MS`), or a pause's decode that the busy pool skipped."""
        config, ledger = self.session.config, self.session.input
        if self._urgent and not self.in_flight and is_semantic(config):
            self.on_pause()
        elif (
            self.plugin.transcribes_partials
            and streams_transcripts(config)
            and ledger.samples * 1000 <= MAX_PARTIAL_MS * ledger.sample_rate_hz
        ):
            self._start(urgent=False)

    def on_pause(self) -> None:
        """semantic_vad heard a pause: its verdict needs the words up to it."""
        if self.plugin.transcribes_partials and is_semantic(self.session.config):
            self._start(urgent=True)

    def _start(self, *, urgent: bool) -> None:
        ledger = self.session.input
        if ledger.speech_started_ms is None or ledger.speech_stopped or ledger.item_id is None:
            self._urgent = False
            return  # nobody is speaking: no turn to transcribe
        if ledger.item_id != self._item_id:  # a new turn (after a commit, clear or cancel)
            self.reset()
            self._item_id = ledger.item_id
        if self.in_flight:
            self._urgent = self._urgent or urgent
            return
        urgent, self._urgent = urgent or self._urgent, False
        if not urgent and self._words.closed:
            return  # no more deltas for this item: only semantic_vad's pauses need words
        new = ledger.samples - self._decoded_samples
        if new <= 0 or (not urgent and new * 1000 < CADENCE_MS * ledger.sample_rate_hz):
            return
        if not self.pool.reserve():  # the pool is busy: asked again at the next append
            self._urgent = urgent
            return
        cap = MAX_PARTIAL_MS * ledger.sample_rate_hz // 1000
        audio = ledger.peek()[-cap:]  # never written in place: safe to read from a thread
        future = self.pool.submit(self.plugin.transcribe_partial, audio, ledger.sample_rate_hz)
        if future is None:
            return
        self.in_flight = True
        self.decodes += 1
        self._decoded_samples = ledger.samples
        result = PartialTranscript(
            self.token, ledger.item_id, None, ledger.stream_ms, whole=ledger.samples <= cap
        )
        self._task = start_task(
            self._decode(result, future), f"session-partial:{self.session.session_id}"
        )

    async def _decode(self, result: PartialTranscript, future: Future[Any]) -> None:
        try:
            result.text = await asyncio.wrap_future(future)
        except Exception:  # a partial is a preview: the commit's transcript still comes
            log.warning(
                "session %s: partial transcription failed", self.session.session_id, exc_info=True
            )
        self.deliver(result)

    # ------------------------------------------------------------ results

    def apply(self, result: PartialTranscript) -> str | None:
        """A decode's result, on the runner's task: emit its delta if it is still the
        current turn's; returns its text then (None when stale or failed)."""
        self.in_flight, self._task = False, None
        ledger = self.session.input
        fresh = (
            result.token == self.token
            and result.item_id == ledger.item_id
            and ledger.speech_started_ms is not None
            and not ledger.speech_stopped
        )
        text = result.text if fresh else None
        if text is not None and result.whole and streams_transcripts(self.session.config):
            delta = self._words.update(text)
            if delta:
                self.emit(
                    InputAudioTranscriptionDelta(
                        item_id=result.item_id, content_index=0, delta=delta
                    )
                )
        urgent, self._urgent = self._urgent, False
        if urgent:
            self.on_pause()
        else:
            self.on_audio()  # the turn may have grown past the cadence meanwhile
        return text


__all__ = [
    "CADENCE_MS",
    "MAX_PARTIAL_MS",
    "TRANSCRIPTION_FAILED",
    "PartialPool",
    "PartialTranscriber",
    "PartialTranscript",
    "StableWords",
    "is_semantic",
    "reports_transcripts",
    "streams_transcripts",
    "transcript_events",
    "transcription_setting",
]
