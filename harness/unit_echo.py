"""A deterministic frame-clocked model of 1 s units that sees, for tests, without torch:
`UnitEchoFrameModel` and its plugin `UnitEchoFramePlugin`
(`duplex worker --plugin harness.unit_echo:UnitEchoFramePlugin`): the shape of MiniCPM-o
4.5's clock (one step per 1 s unit of 16 kHz audio), its camera frames (one JPEG or PNG a
unit) and its records (of variable size: the unit's audio when it had any, and the images
it saw), with none of its model.

Each slot hears a unit, quantised to 16-bit (what its record keeps, so a replay hears the
same numbers), and says it back one unit later when it was loud (RMS over `SPEECH_RMS`).
It speaks in a unit whose delayed audio was loud, or that came with camera frames (it says
what it saw); its text is `"<unit> <memory>"`, plus `" saw <n>: <bytes>,..."` for the
images: `<unit>` counts the slot's units from 0 and `<memory>` is a CRC-32 of every record
so far, so a text names the whole conversation before it, and a slot restored from the
wrong history, or one that forgot a frame, says another number.

An image is "decoded" by its first bytes (JPEG or PNG) and refused when it holds
`BROKEN` (a file that starts right and is damaged after): the unit's output then carries
`FrameOutput.error` (`invalid_video_frames`), the image is not seen, and the slot goes on.

A unit's record (sized: `state_records_sized`) is `RECORD_HEAD` (flags, image count), then
the unit's pcm16 audio when it was loud (`LOUD`; a quiet unit's audio is not needed: it is
never said back), then each image seen as its length (uint32 LE) and bytes; `INTERRUPTED`
says a barge-in came before the unit (`interrupt_slot`: it drops what it was about to say).
Its state after N units (the unit count, the CRC, the audio it is about to say) is a pure
function of its N records: `restore_slot` checks the history and `replay_work` folds it in,
as many units a call as the stage asks.
"""

from __future__ import annotations

import dataclasses
import struct
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from shared.contracts import (
    FrameClockedPlugin,
    FrameModel,
    FrameOutput,
    ImageInput,
    image_format,
    split_records,
)

RATE = 16_000
UNIT_SAMPLES = RATE  # one 1 s unit of 16 kHz audio, as MiniCPM-o's
#: RMS above which a unit is speech
SPEECH_RMS = 0.01
#: an image holding this is one the model cannot decode
BROKEN = b"broken"
#: one camera frame a unit, as MiniCPM-o's duplex loop takes them
IMAGES = ImageInput(max_per_frame=1, max_bytes=64 * 1024)

#: a record's head: flags, then how many images follow the audio
RECORD_HEAD = struct.Struct("<BB")
LOUD = 0x01  # the unit's pcm16 audio follows the head
INTERRUPTED = 0x02  # a barge-in came before this unit
IMAGE_LENGTH = struct.Struct("<I")
#: the longest record: the head, a unit's pcm16, and the most images at their most bytes
MAX_RECORD_BYTES = (
    RECORD_HEAD.size
    + 2 * UNIT_SAMPLES
    + IMAGES.max_per_frame * (IMAGE_LENGTH.size + IMAGES.max_bytes)
)


@dataclasses.dataclass
class UnitSlot:
    """What a slot holds: its units so far, its memory, what it will say next."""

    units: int = 0
    crc: int = 0
    #: the last unit's audio when it was loud (said back at the next unit), else None
    pending: np.ndarray | None = None
    #: a barge-in came since the last unit: the next record says so
    interrupted: bool = False
    #: records still to fold in (a restore), oldest first
    replay: list[bytes] = dataclasses.field(default_factory=list)


def unit_text(unit: int, crc: int, seen: Sequence[bytes]) -> str:
    """What the model says in unit `unit` (module head)."""
    text = f"{unit} {crc:08x}"
    if seen:
        text += f" saw {len(seen)}: " + ",".join(str(len(image)) for image in seen)
    return text


class UnitEchoFrameModel(FrameModel):
    input_sample_rate_hz = RATE
    output_sample_rate_hz = RATE
    frame_samples = UNIT_SAMPLES
    image_input = IMAGES
    state_record_bytes = MAX_RECORD_BYTES
    state_records_sized = True

    def __init__(
        self, slots: int, *, replay_chunk_frames: int = 4, replay_frame_s: float = 0.0
    ) -> None:
        self.slots = slots
        self.replay_chunk_frames = replay_chunk_frames
        #: seconds a replayed unit keeps the model thread busy (0: free)
        self.replay_frame_s = replay_frame_s
        self._slots: list[UnitSlot | None] = [None] * slots
        self.interrupts = [0] * slots
        #: the images the latest steps gave each slot (a test reads what reached the model)
        self.seen: deque[list[tuple[bytes, ...]]] = deque(maxlen=1000)
        #: called at each step, on the model thread (a test's step that fails)
        self.on_step: Callable[[], None] | None = None
        self.closed = False

    # ------------------------------------------------------------ slots

    def open_slot(self, slot: int, options: Mapping[str, Any]) -> None:
        if self._slots[slot] is not None:
            raise RuntimeError(f"slot {slot} is already open")
        self._slots[slot] = UnitSlot()

    def restore_slot(self, slot: int, options: Mapping[str, Any], history: bytes) -> None:
        records = split_records(history, self.state_record_bytes, sized=True)
        for record in records:  # a history that does not parse is refused before the open
            _parse(record)
        self.open_slot(slot, options)
        self._state(slot).replay = records

    def replay_pending(self, slot: int) -> int:
        return len(self._state(slot).replay)

    def replay_work(self, slot: int, frames: int) -> int:
        if not 1 <= frames <= self.replay_chunk_frames:
            raise ValueError(f"asked to replay {frames} frames (1..{self.replay_chunk_frames})")
        state = self._state(slot)
        taken, state.replay = state.replay[:frames], state.replay[frames:]
        if self.replay_frame_s:
            time.sleep(len(taken) * self.replay_frame_s)  # the model thread busy, as a real one
        for record in taken:
            self._fold(state, record)
        return len(state.replay)

    def interrupt_slot(self, slot: int) -> None:
        state = self._state(slot)
        self.interrupts[slot] += 1
        state.pending = None  # what it was about to say
        state.interrupted = True

    def close_slot(self, slot: int) -> None:
        self._slots[slot] = None

    def close(self) -> None:
        self.closed = True

    def _state(self, slot: int) -> UnitSlot:
        state = self._slots[slot]
        if state is None:
            raise RuntimeError(f"slot {slot} is not open")
        return state

    # ------------------------------------------------------------ the step

    def step(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> list[FrameOutput | None]:
        active = self.checked_active(frames, active, images)
        if self.on_step is not None:
            self.on_step()
        for slot in np.flatnonzero(active):
            if self._state(int(slot)).replay:
                raise ValueError(f"slot {slot} is still replaying its history")
        given = list(images) if images is not None else [()] * self.slots
        self.seen.append(given)
        outputs: list[FrameOutput | None] = []
        for slot in range(self.slots):
            if not active[slot]:
                outputs.append(None)
                continue
            outputs.append(self._step_slot(self._state(slot), frames[slot], given[slot]))
        return outputs

    def _step_slot(self, state: UnitSlot, frame: np.ndarray, images: tuple[bytes, ...]):
        pcm = np.clip(np.round(frame * 32768.0), -32768, 32767).astype("<i2")
        heard = pcm.astype(np.float32) / 32768.0
        loud = float(np.sqrt(np.mean(heard**2))) > SPEECH_RMS
        seen = [image for image in images if _decodes(image)]
        error = None
        if len(seen) < len(images):
            error = ("invalid_video_frames", "a video frame could not be decoded: not seen")
        flags = (LOUD if loud else 0) | (INTERRUPTED if state.interrupted else 0)
        record = RECORD_HEAD.pack(flags, len(seen)) + (pcm.tobytes() if loud else b"")
        record += b"".join(IMAGE_LENGTH.pack(len(image)) + image for image in seen)
        said, unit = state.pending, state.units
        self._fold(state, record)
        text = unit_text(unit, state.crc, seen)
        if said is None and not seen:
            return FrameOutput(np.zeros(0, np.float32), record=record, error=error)
        audio = said if said is not None else np.zeros(UNIT_SAMPLES, np.float32)
        return FrameOutput(audio, text, True, record, error=error)

    def _fold(self, state: UnitSlot, record: bytes) -> None:
        """The slot's state after one more unit of `record` (a step, or its replay). A
        barge-in's mark (`INTERRUPTED`) changed what the unit said, not what comes after
        it: it is in the memory (the CRC) all the same."""
        _, audio, _ = _parse(record)
        state.interrupted = False
        state.pending = audio
        state.units += 1
        state.crc = zlib.crc32(record, state.crc)


def _decodes(image: bytes) -> bool:
    return image_format(image) is not None and BROKEN not in image


def _parse(record: bytes) -> tuple[int, np.ndarray | None, list[bytes]]:
    """(flags, the unit's audio when loud, the images seen) of a record; ValueError when
    it is not one."""
    flags, count = RECORD_HEAD.unpack_from(record)
    offset, audio = RECORD_HEAD.size, None
    if flags & LOUD:
        pcm = np.frombuffer(record, "<i2", UNIT_SAMPLES, offset)
        audio = pcm.astype(np.float32) / 32768.0
        offset += 2 * UNIT_SAMPLES
    seen = []
    for _ in range(count):
        (length,) = IMAGE_LENGTH.unpack_from(record, offset)
        offset += IMAGE_LENGTH.size
        seen.append(record[offset : offset + length])
        offset += length
    if offset != len(record):
        raise ValueError(f"a record of {len(record)} bytes that is not one unit's")
    return flags, audio, seen


class UnitEchoFramePlugin(FrameClockedPlugin):
    """The plugin of `UnitEchoFrameModel`. Options (`--plugin-option`): `slots` (the
    model's batch, below the worker's max sessions), `replay_frame_s` (seconds a replayed
    unit keeps the model thread busy: a restore that takes time)."""

    plugin_id = "unit_echo"
    input_sample_rate_hz: ClassVar[int] = RATE
    output_sample_rate_hz: ClassVar[int] = RATE
    frame_period_ms: ClassVar[int] = 1000
    image_input: ClassVar[ImageInput | None] = IMAGES

    def __init__(self, slots: int | None = None, replay_frame_s: float = 0.0) -> None:
        self.slots = slots
        self.replay_frame_s = replay_frame_s
        self.models: list[UnitEchoFrameModel] = []

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> UnitEchoFramePlugin:
        slots = options.get("slots")
        return cls(
            slots=int(slots) if slots is not None else None,
            replay_frame_s=float(options.get("replay_frame_s", 0.0)),
        )

    def frame_model(self, max_sessions: int) -> UnitEchoFrameModel:
        slots = min(max_sessions, self.slots) if self.slots else max_sessions
        model = UnitEchoFrameModel(slots, replay_frame_s=self.replay_frame_s)
        self.models.append(model)
        return model
