"""`SlotState`: one session's slot of the tick-batched stage (a row of the batch).

What the stage keeps of a session between ticks: its model slot and whether it is open,
its request id and fence, its input buffer (bounded: input far ahead of the clock is cut,
oldest first; a jitter buffer when the client's chunks are longer than a frame), the camera
frames waiting for the frame of input they go with, and its turn taking (listening, or
speaking a response that `listen_after_frames` quiet frames or `max_response_frames` end).

Camera frames (a model with `FrameModel.image_input`) go with their audio: an append's
images are attached to the frame of input that holds the append's last sample (a client
captures a frame as it sends the audio before it), so they reach the model in the step of
that frame, whenever the tick takes it, and never with a frame stepped on silence. This is
vLLM-Omni's MiniCPM-o rule (a frame queued with its append goes with the next whole unit
of audio, one a unit) made exact for a buffer the clock drains: a frame of input takes
every image attached to it, and those of input cut before it (a client far ahead, a
restore's catch-up). Where more than the model takes in one frame (`max_per_frame`) come
due, the newest are kept and the oldest dropped (counted): a camera frame shows the scene
now, and a backlog, which vLLM-Omni's unbounded queue lets grow, would show the model a
scene further behind its audio each unit.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import numpy as np

from shared.contracts import DuplexFence, ModelHistory, OutputSink

#: the jitter buffer is never deeper than this (3 of Moshi's 80 ms frames): a time, the
#: latency a burst may add, whatever the model's clock (`jitter_cap_samples`)
MAX_JITTER_MS = 240
#: the appends whose longest sets the jitter buffer's depth (about a second of GPT-Live's)
RECENT_CHUNKS = 8


def jitter_cap_samples(frame_samples: int, rate_hz: int) -> int:
    """The deepest the jitter buffer gets (`SlotState.resume_at`): `MAX_JITTER_MS`, or a
    frame and a quarter where that is more (a 1 s unit: the buffer must hold a whole frame
    to take one, and the quarter frame of jitter the depth rule allows for)."""
    return max(-(-MAX_JITTER_MS * rate_hz // 1000), frame_samples + frame_samples // 4)


@dataclasses.dataclass
class ReplayCost:
    """What a `replay_work` call of n frames costs on the model thread: `fixed_s` + n x
    `frame_s`, fitted by least squares to the calls measured so far, each call weighing
    `1 - weight` times the one after it (the cost drifts with the history's length).

    The fixed part is real: a model that replays a call's frames in one forward pays its
    overhead once a call (on a small batch most of the call), so a call of 40 frames costs
    far less than 40 calls of one. A cost per frame alone, measured on small calls, counted
    that part in every frame: it asked for too few frames, then spent the tick's rest on
    more small calls that each paid it again."""

    weight: float
    fixed_s: float = 0.0
    frame_s: float = 0.0
    # the weighted sums of the fit: calls, frames, frames squared, seconds, frames x seconds
    _calls: float = 0.0
    _frames: float = 0.0
    _squares: float = 0.0
    _seconds: float = 0.0
    _products: float = 0.0

    def add(self, frames: int, seconds: float) -> None:
        keep, n = 1.0 - self.weight, float(max(frames, 1))
        self._calls = keep * self._calls + 1.0
        self._frames = keep * self._frames + n
        self._squares = keep * self._squares + n * n
        self._seconds = keep * self._seconds + seconds
        self._products = keep * self._products + n * seconds
        spread = self._calls * self._squares - self._frames**2
        if spread > 1e-9 * self._calls * self._squares:  # calls of more than one size
            slope = (self._calls * self._products - self._frames * self._seconds) / spread
            fixed = (self._seconds - slope * self._frames) / self._calls
            if slope > 0 and fixed >= 0:
                self.frame_s, self.fixed_s = slope, fixed
                return
        size, call_s = self._frames / self._calls, self._seconds / self._calls
        if 0 < self.fixed_s < call_s:
            # calls of one size lately (full ones), or a fit the noise made senseless: the
            # fixed part found before stays, the part per frame follows the calls' cost
            # (all of it per frame would ask a smaller call for more than fits)
            self.frame_s = (call_s - self.fixed_s) / size
            return
        # one size of call so far: all of it per frame, which over-counts a fixed part and
        # so never asks a call as large or larger for more than fits
        self.frame_s, self.fixed_s = max(call_s / size, 1e-9), 0.0

    def seconds(self, frames: int) -> float:
        return self.fixed_s + frames * self.frame_s

    def fits(self, budget_s: float) -> int:
        """The most frames one call replays within `budget_s` (0: not even one)."""
        if budget_s <= self.fixed_s:
            return 0
        return int((budget_s - self.fixed_s) / self.frame_s + 1e-9)


@dataclasses.dataclass
class SlotReplay:
    """A slot's replay (a restore's history, a prompt given as the model's inputs): what
    it has left and what a call of it costs, measured as it goes (the tick stage sizes
    its calls by it)."""

    #: frames to replay at its start
    frames: int
    #: frames still to replay (`replay_pending` after the last call)
    left: int
    started: float
    #: what a call costs on the model thread (fitted to its calls); None: not measured
    cost: ReplayCost | None = None
    #: frames the last call replayed and its seconds (the next asks at most twice as many
    #: frames, or what twice its time holds)
    last_frames: int = 0
    last_s: float = 0.0
    calls: int = 0
    #: model-thread seconds spent so far
    busy_s: float = 0.0
    ended: float | None = None

    @property
    def replayed(self) -> int:
        return self.frames - self.left

    def chunk(self, share_s: float, spare_s: float, most: int, known: ReplayCost | None) -> int:
        """Frames to ask for with `share_s` seconds for this replay and `spare_s` for
        all of them: as many as one call fits in the share (one if only the spare holds
        one), never more than `most`, twice the last call's, or what is left; 0: none
        fits. Until it has measured its own cost, the model's last measured one (`known`)
        stands for it; with neither, one frame tells what a frame costs."""
        cost = self.cost if self.cost is not None else known
        fit = 1  # a probe
        if cost is not None:
            fit = cost.fits(share_s) or (1 if spare_s >= cost.seconds(1) else 0)
        # a cost measured low cannot ask for a long stall: at most twice the last call's
        # frames, or as many as twice its time holds (the same for a cost all per frame;
        # far more when a call's fixed part is most of it). A restore that started from the
        # model's last cost has measured nothing itself.
        ramp = most
        if self.last_frames:
            ramp = 2 * self.last_frames
            if self.cost is not None:
                ramp = max(ramp, self.cost.fits(2 * self.last_s))
        return max(0, min(fit, most, ramp, self.left))

    def account(self, frames: int, seconds: float, weight: float, fitted: bool = True) -> None:
        """A call replayed `frames` in `seconds`: the fitted cost follows it (unless not
        `fitted`: a prompt taken whole, whose cost is not its positions')."""
        self.calls += 1
        self.busy_s += seconds
        if not fitted:
            return
        self.last_frames, self.last_s = max(frames, 1), seconds
        if self.cost is None:
            self.cost = ReplayCost(weight)
        self.cost.add(frames, seconds)


@dataclasses.dataclass(frozen=True)
class PendingImage:
    """A camera frame waiting for the frame of input it goes with."""

    #: the input sample its append's audio ended at (exclusive, counted from the slot's
    #: first): it goes with the frame of input that holds the sample before it
    at: int
    data: bytes


@dataclasses.dataclass
class SlotState:
    """One session's slot: everything the stage keeps of the session, from its `bind`
    (the sink) to the end of its slot's `close_slot`. Written on the event loop only (the
    tick, ensure, feed, cleanup)."""

    #: the model's slot (a row of the batch); None: bound, no slot taken yet (`ensure`)
    index: int | None
    session_id: str
    frame_samples: int
    #: input beyond this is cut back (oldest first): a client far ahead of the clock
    max_buffered_samples: int
    #: the jitter buffer is never deeper than this (`jitter_cap_samples`)
    max_jitter_samples: int
    #: the most images one frame of it carries to the model (0: the model takes none)
    max_images: int = 0
    #: where the session's outputs go (`bind`); None once its cleanup began
    sink: OutputSink | None = None
    #: the session let go of the slot (`cleanup`): no step, no output; the slot goes back
    #: to the free list once its `close_slot` ran (a failed one is tried again)
    closing: bool = False
    #: the slot's `close_slot` in flight: a second cleanup meanwhile awaits the same one
    close_call: asyncio.Future[None] | None = None
    request_id: str | None = None
    fence: DuplexFence | None = None
    #: `open_slot` ran: the slot is stepped as active
    opened: bool = False
    #: the slot's `open_slot` on the model thread (None: never submitted)
    opening: asyncio.Future[None] | None = None
    #: bumped by an abort or a close: the outputs of a step gathered before are dropped
    generation: int = 0
    #: the request an abort named: no output is sent under it again
    aborted_request_id: str | None = None
    #: where the model's records of this slot's frames go (the session's history)
    history: ModelHistory | None = None
    #: the model is rebuilding the slot (`replay_work`): not stepped until it is None
    replay: SlotReplay | None = None
    #: the slot was opened from a session's history (a restore), not fresh
    restoring: bool = False
    #: the last replay's figures once it ended (`restore_progress` reports it)
    replayed: SlotReplay | None = None
    #: the session is told once the slot has stepped its prompt (`StageOutput` "ready")
    announce_ready: bool = False
    #: the session's input is its clock (`StagePlan.client_clock`): past its prompt, the
    #: slot steps only on a whole frame of input, and every frame it steps is sent
    client_clocked: bool = False
    #: ticks in a row this client-clocked slot ended more than `CLIENT_LAG_MS` behind with
    #: no new low of its backlog (`lag_low`, in samples, None while it is not behind)
    lagging_ticks: int = 0
    lag_low: int | None = None
    #: ticks in a row it ended more than `CLIENT_LAG_MS` behind, draining or not
    behind_ticks: int = 0
    chunks: list[np.ndarray] = dataclasses.field(default_factory=list)
    buffered: int = 0
    #: the input sample (counted from the slot's first) the buffer starts at: the end of
    #: the input taken or cut so far
    start_sample: int = 0
    #: camera frames waiting for their frame of input, oldest first
    images: collections.deque[PendingImage] = dataclasses.field(default_factory=collections.deque)
    dropped_images: int = 0
    #: the sizes of the latest appends (samples): the jitter buffer's depth follows the
    #: longest (a burst deepens it for these appends only)
    recent_chunks: collections.deque[int] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT_CHUNKS)
    )
    #: frames are taken as they come; False at the start and after a frame found too
    #: little input, until the buffer is back at `resume_at`
    flowing: bool = False
    #: speaking a response (its frames go to the session); False: listening
    responding: bool = False
    quiet_frames: int = 0
    response_frames: int = 0
    silence_frames: int = 0
    dropped_samples: int = 0

    @property
    def replaying(self) -> bool:
        return self.replay is not None

    @property
    def waits_for_input(self) -> bool:
        """A client-clocked slot past its prompt with no whole frame of input: its client
        is the clock, and it has not ticked (the slot skips the step, its state kept)."""
        past_prompt = self.client_clocked and not self.announce_ready
        return past_prompt and self.buffered < self.frame_samples

    @property
    def behind(self) -> bool:
        """A client-clocked slot with a whole frame of input left after the tick's step: its
        client is ahead (a burst, early audio, a worker that fell behind)."""
        past_prompt = self.client_clocked and not self.announce_ready
        return past_prompt and self.buffered >= self.frame_samples

    # ------------------------------------------------------------ input

    def feed(self, samples: np.ndarray) -> int:
        """Append input; returns the samples cut from the front to stay under the bound."""
        if not samples.size:
            return 0
        self.chunks.append(np.asarray(samples, dtype=np.float32).reshape(-1))
        self.buffered += samples.size
        self.recent_chunks.append(samples.size)
        return self._cut_to(self.max_buffered_samples)

    def attach(self, images: tuple[bytes, ...]) -> int:
        """The camera frames of the input fed last: they go with the frame that holds its
        last sample (module head). Returns the images dropped: the oldest, past what the
        input buffer's frames could carry (a client sending more images than audio; the
        frames would drop them anyway when taken)."""
        at = self.start_sample + self.buffered
        self.images.extend(PendingImage(at, image) for image in images)
        most = self.max_images * (self.max_buffered_samples // self.frame_samples + 1)
        dropped = 0
        while len(self.images) > most:
            self.images.popleft()
            dropped += 1
        self.dropped_images += dropped
        return dropped

    def take_images(self) -> tuple[tuple[bytes, ...], int]:
        """After `take_frame` took a frame: (the images that go with it, oldest first; the
        images dropped). It takes every image whose audio ended in it or before it (cut
        input), the newest `max_images` of them (module head)."""
        due: list[bytes] = []
        while self.images and self.images[0].at <= self.start_sample:
            due.append(self.images.popleft().data)
        kept = due[len(due) - self.max_images :] if len(due) > self.max_images else due
        dropped = len(due) - len(kept)
        self.dropped_images += dropped
        return tuple(kept), dropped

    @property
    def resume_at(self) -> int:
        """The input a slot holds before it takes frames again (at the start, and after a
        frame found too little): one frame while the client sends chunks of a frame or
        less; else a chunk and a quarter frame (at most `max_jitter_samples`).

        Chunks longer than a frame arrive out of step with the ticks (GPT-Live's 100 ms
        against Moshi's 80): taken as they come, a tick before the next chunk finds too
        little, and the model hears a frame of silence in the middle of the user's speech.
        Held this deep, no tick runs dry while chunks keep their pace (jitter of a quarter
        frame included); the cost is the extra depth, paid once, and never a gap once the
        audio flows (tests/worker/stages/test_jitter.py)."""
        frame, chunk = self.frame_samples, max(self.recent_chunks, default=0)
        if chunk <= frame or self.client_clocked:
            return frame  # a client-clocked slot steps when a frame is whole: no gap to cover
        # a burst (a client far ahead, a file sent at once) does not make the buffer deep
        return min(chunk + frame // 4, self.max_jitter_samples, self.max_buffered_samples)

    def take_frame(self, into: np.ndarray) -> bool:
        """Fill `into` with the next frame of input; False (and `into` left zero, the input
        kept for the next tick) when a whole frame has not arrived, or while the jitter
        buffer fills (`resume_at`)."""
        if not self.flowing and self.buffered >= self.resume_at:
            self.flowing = True
        if not self.flowing or self.buffered < self.frame_samples:
            self.flowing = False
            self.silence_frames += 1
            return False
        audio = np.concatenate(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        into[:] = audio[: self.frame_samples]
        rest = audio[self.frame_samples :]
        self.chunks, self.buffered = ([rest] if rest.size else []), rest.size
        self.start_sample += self.frame_samples
        return True

    def keep_latest(self, frames: int) -> int:
        """Cut the input back to its newest `frames` frames; returns the samples cut."""
        return self._cut_to(frames * self.frame_samples)

    def _cut_to(self, samples: int) -> int:
        """Keep the newest `samples` of input; returns the samples cut (counted)."""
        excess = self.buffered - samples
        if excess <= 0:
            return 0
        audio = np.concatenate(self.chunks)[excess:]
        self.chunks, self.buffered = [audio], audio.size
        self.start_sample += excess  # images of the input cut go with the next frame taken
        self.dropped_samples += excess
        return excess

    @property
    def opened_in_model(self) -> bool:
        """The model holds this slot open: its `open_slot` ran to its end."""
        opening = self.opening
        return (
            opening is not None
            and opening.done()
            and not opening.cancelled()
            and opening.exception() is None
        )

    # ------------------------------------------------------------ turn taking

    def listen(self) -> None:
        self.responding = False
        self.quiet_frames = self.response_frames = 0

    def on_frame(self, speaking: bool, listen_after: int, max_frames: int) -> tuple[bool, bool]:
        """(send this frame to the session, then end the response with "listen")."""
        if not self.responding:
            if not speaking:
                return False, False  # listening: the model's quiet frames are not sent
            self.responding = True
            self.quiet_frames = self.response_frames = 0
        self.response_frames += 1
        self.quiet_frames = 0 if speaking else self.quiet_frames + 1
        ends = self.quiet_frames >= listen_after or self.response_frames >= max_frames
        if ends:
            self.listen()
        return True, ends
