"""Turn detection's `idle_timeout_ms`: prompt a user who has gone quiet.

GA semantics: after the last response's audio has finished playing, if the user says
nothing for `idle_timeout_ms`, the server emits `input_audio_buffer.timeout_triggered
{audio_start_ms, audio_end_ms, item_id}`, commits the (silent) buffer as a user item and
creates a response, so the model can follow up (`InputController.idle_timeout`).

When the timer runs (docs/wire-api.md, "Turn detection"):

- armed at each `response.done` (completed, cancelled or failed) unless the user is
  speaking then (a barge-in); disarmed by `response.created`, `speech_started` and
  `input_audio_buffer.committed`, and by a session.update that removes the setting;
  never in a model-native session (the model decides when to speak);
- it counts from the end of the response's playback, in session audio time: the input
  stream's position at the response's first audio plus the audio it generated, or the
  position at `response.done` if that is later (a response paced in real time has
  played out by then; an unpaced one plays for its whole length after);
- the clock is the input audio itself while the client streams: the timeout fires when
  an append takes the stream `idle_timeout_ms` past that point, so it is exact and does
  not depend on network jitter. A client that stops streaming still gets it: a
  wall-clock check wakes when the audio would have reached the deadline in real time;
  if no audio arrived in the last `STALL_GRACE_S`, it fires then (`audio_end_ms` is
  where the stream stopped, `audio_start_ms` no later than that), otherwise it waits for
  the audio clock (and checks again in at least `STALL_GRACE_S`).

The wall-clock task is the runner's (cancelled by `stop`, at close and at a move); its
check goes through the mailbox, so the timer is only read and written on the runner's
task. A timer armed when the session moves is not carried: the next response re-arms it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.worker.engine.engine_session import EngineSession
from services.worker.engine.input_queue import start_task
from shared.protocol.duplex import DuplexEvent

#: a client whose last append is older than this has stopped streaming
STALL_GRACE_S = 1.0


@dataclasses.dataclass
class IdleDue:
    """The wall-clock check of the timer armed as `token`, for the runner's mailbox."""

    token: int


@dataclasses.dataclass(frozen=True)
class IdleSpan:
    """The silent segment a timeout reports: after the playback, up to the trigger."""

    audio_start_ms: int
    audio_end_ms: int


class IdleTimer:
    def __init__(
        self,
        session: EngineSession,
        deliver: Callable[[Any], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.session = session
        self.deliver = deliver
        self.clock = clock  # injectable: tests drive the stall check without real time
        self.sleep = sleep
        self.token = 0
        self.start_ms: int | None = None  # armed: where the silence is counted from
        self._speak_ms: int | None = None  # stream time of the active response's first audio
        self._last_audio = clock()
        self._task: asyncio.Task[None] | None = None
        #: stopped with the runner: the cancelled chain that `stop` emits after (a response
        #: still active at a close or a move) must not start a timer nobody will stop
        self.stopped = False

    @property
    def armed(self) -> bool:
        return self.start_ms is not None

    def timeout_ms(self) -> int | None:
        td = self.session.config.turn_detection
        if td is None or self.session.model_native:
            return None
        return td.idle_timeout_ms

    # ------------------------------------------------------------ arming

    def observe(self, event: DuplexEvent) -> None:
        """Every event the session emits passes here (the runner's `emit`)."""
        kind = event.wire_type
        if kind == "response.speak":
            self._speak_ms = self.session.input.stream_ms
        elif kind == "response.done":
            self._response_done(event)
        elif kind in _DISARMING:
            if kind == "response.created":
                self._speak_ms = None
            self.disarm()

    def _response_done(self, event: Any) -> None:
        stream_ms = self.session.input.stream_ms
        response = self.session.responses.get(getattr(event, "response_id", None) or "")
        played_out = stream_ms
        if response is not None and self._speak_ms is not None:
            played_out = max(stream_ms, self._speak_ms + int(response.playback.generated_ms))
        self._speak_ms = None
        ledger = self.session.input
        if self.stopped or self.timeout_ms() is None or ledger.speech_started_ms is not None:
            return  # off, or the user is speaking (their turn re-arms after its response)
        self.disarm()
        self.start_ms = played_out
        self._schedule(self._audio_left_s())

    def disarm(self) -> None:
        self.token += 1
        self.start_ms = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    async def stop(self) -> None:
        task, self.stopped = self._task, True
        self.disarm()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    # ------------------------------------------------------------ the two clocks

    def _deadline_ms(self) -> int | None:
        timeout = self.timeout_ms()
        if self.start_ms is None or timeout is None:
            return None
        return self.start_ms + timeout

    def _audio_left_s(self) -> float:
        deadline = self._deadline_ms()
        return 0.0 if deadline is None else max(0, deadline - self.session.input.stream_ms) / 1000

    def due_by_audio(self) -> bool:
        """An append was applied: whether the stream has passed the deadline."""
        self._last_audio = self.clock()
        deadline = self._deadline_ms()
        return deadline is not None and self.session.input.stream_ms >= deadline

    def due_by_wall(self, due: IdleDue) -> bool:
        """The wall-clock check: fire if the client stopped streaming; otherwise leave it
        to the audio clock and check again later."""
        if due.token != self.token or self.start_ms is None:
            return False  # disarmed or re-armed since
        deadline = self._deadline_ms()
        if deadline is None:
            self.disarm()  # a session.update turned it off
            return False
        if self.session.input.stream_ms >= deadline:
            return True
        if self.clock() - self._last_audio >= STALL_GRACE_S:
            return True
        self._schedule(max(self._audio_left_s(), STALL_GRACE_S))
        return False

    def fire(self) -> IdleSpan | None:
        """The timeout fires: its span, or None when the session is not idle after all (a
        response, a commit on its way, the user speaking: theirs is the next turn). The
        timer is disarmed until the next response either way."""
        session, end = self.session, self.session.input.stream_ms
        start = min(self.start_ms if self.start_ms is not None else end, end)
        self.disarm()
        busy = session.active is not None or session.pending_commits > 0
        if busy or session.input.speech_started_ms is not None:
            return None
        return IdleSpan(start, end)

    def _schedule(self, delay_s: float) -> None:
        if self._task is not None:
            self._task.cancel()
        self._task = start_task(
            self._wake(self.token, delay_s), f"session-idle:{self.session.session_id}"
        )

    async def _wake(self, token: int, delay_s: float) -> None:
        await self.sleep(delay_s)
        self.deliver(IdleDue(token))


_DISARMING = frozenset(
    {
        "response.created",
        "input_audio_buffer.speech_started",
        "input_audio_buffer.committed",
    }
)

__all__ = ["STALL_GRACE_S", "IdleDue", "IdleSpan", "IdleTimer"]
