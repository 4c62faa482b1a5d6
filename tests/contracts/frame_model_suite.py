"""The contract every `FrameModel` keeps (shared/contracts/frame_model.py), as one suite.

Each model runs it in the venv where it runs, through a *subject* (`FrameSubject`): how to
build the model with N slots, the input frames of a conversation, and what of each output
frame is compared. A test module subclasses `FrameModelContract` and gives it a `subject`
fixture (module-scoped, parametrized over its models: a subject caches the reference runs
the tests share):

- tests/contracts/test_frame_model_contract.py: EchoFrameModel, ToolEchoFrameModel (main venv)
- tests/plugins/moshi/test_frame_contract.py: the tiny Moshi and PersonaPlex (.venv-moshi)
- tests/plugins/nemotron/test_frame_contract.py: the tiny Nemotron VoiceChat (.venv-nemotron)

A conversation is a seed: its input frames are `subject.frame(model, slot, seed, index)`, the
same wherever and whenever it runs, so its outputs are compared with the *reference* run of
the same seed (a model of one slot, that conversation alone from its open). The items:

1. a restored slot continues exactly as the original would (records, tokens, output),
   restored beside busy neighbours, from a history longer than the model's context where it
   has one, replayed in uneven chunks through `replay_work(slot, n)`;
2. an interrupt keeps the memory: the slot goes on from its history (not as a fresh one),
   and a restore of the history with the interrupt in it continues as the interrupted slot;
3. slots are isolated: a conversation's outputs are its reference's whoever shares the batch
   (joining, leaving, interrupted, reopened), and a slot left inactive does not change;
4. a step that fails after the model advanced hands over its frame's records
   (`FrameStepError.records`): they are the frame's records, and with them the history
   restores elsewhere as the conversation goes on;
5. a second open of a slot (open, step, interrupt, close, open) is a fresh conversation;
6. `replay_work(slot, n)` takes exactly min(n, pending) frames off `replay_pending` for
   every n in 1..`replay_chunk_frames` and returns what is left (the stage's cost per
   frame is its time over those frames), and refuses any other n (ValueError); a model
   with `state_record_bytes == 0` refuses `restore_slot` (NotImplementedError) instead and
   has nothing to replay;
7. a model that takes images (`image_input`) sees them: a conversation's camera frames
   (`subject.images`) change what it does from the frame they come with, and a model that
   takes none is never passed any.

Records are checked in the model's layout (shared/contracts/model_history.py): every record
`state_record_bytes` long, or, sized, at most that; histories are built and counted in it.

Where part of a model's state is deliberately not in its records, the subject says which
observations may differ for how many frames after a restore, and why
(`restore_may_differ`, `restore_may_differ_why`); everything else must be equal. Where an
item does not apply to a model, the test asserts what the model does instead.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from shared.contracts.frame_model import FrameModel, FrameOutput, FrameStepError
from shared.contracts.model_history import count_records, join_records

#: what the suite compares of one output frame: name -> value (arrays within `atol`)
Observation = dict[str, Any]


class FrameSubject(abc.ABC):
    """One model under the contract: how the suite builds, feeds and observes it."""

    #: frames a conversation runs before and after each event (an interrupt, a restore)
    frames: int = 12
    #: frames of the model's context (an attention's window, an encoder's left context),
    #: None when it has none: item 1 then also restores a history this much longer
    context_frames: int | None = None
    #: arrays (audio) are equal within this (0: exactly)
    atol: float = 0.0
    #: observation name -> frames after a restore in which it may differ from the original,
    #: for state the model deliberately keeps out of its records (`restore_may_differ_why`)
    restore_may_differ: Mapping[str, int] = {}
    restore_may_differ_why: str = ""
    #: an interrupt changes the slot's next records (a restore interrupts where it did);
    #: False where the interrupt's whole effect is on state no record holds (say why)
    interrupt_in_records: bool = True
    interrupt_in_records_why: str = ""
    #: the prompt `options` gives (precomputed model inputs, replayed before the first step)
    #: is replayed whole by the first `replay_work` call, however few frames it asks for
    prompt_in_one_piece: bool = False

    def __init__(self) -> None:
        self.references: dict[tuple[int, int | None], Trace] = {}
        #: the model exports its state (known once a test has built one)
        self.restores = False

    @abc.abstractmethod
    def make(self, slots: int) -> FrameModel:
        """A fresh model with `slots` slots."""

    def options(self, seed: int) -> dict[str, Any]:
        """The options conversation `seed` opens (or is restored) with."""
        return {}

    @abc.abstractmethod
    def frame(self, model: FrameModel, slot: int, seed: int, index: int) -> np.ndarray:
        """The input frame `index` of conversation `seed` (in `slot` of `model`), float32
        [frame_samples]; called right before the step that takes it."""

    def images(self, model: FrameModel, slot: int, seed: int, index: int) -> tuple[bytes, ...]:
        """The camera frames that go with input frame `index` of conversation `seed`, for a
        model with `image_input` (none by default)."""
        return ()

    @abc.abstractmethod
    def observe(self, model: FrameModel, slot: int, output: FrameOutput) -> Observation:
        """What is compared of `slot`'s output frame (called right after its step)."""

    def fail_next_step(self, model: FrameModel) -> str | None:
        """Make `model`'s next step fail: "advanced" where it fails after the model's state
        advanced (it must raise FrameStepError), "before" where it can only fail before
        (it raises its error as is, and nothing advanced); None where it cannot fail."""
        return None


@dataclasses.dataclass
class Trace:
    """A conversation's observations and records, frame by frame."""

    seen: list[Observation] = dataclasses.field(default_factory=list)
    records: list[bytes] = dataclasses.field(default_factory=list)


class Run:
    """A model the suite steps: which conversation each open slot holds, at which frame, and
    what each slot's outputs were since it was opened or restored."""

    def __init__(self, subject: FrameSubject, slots: int, *, blind: bool = False) -> None:
        """`blind`: the steps are given no images (the conversations without a camera)."""
        self.subject = subject
        self.blind = blind
        self.model = subject.make(slots)
        assert self.model.slots == slots
        self.seed: dict[int, int] = {}
        self.index: dict[int, int] = {}
        self.traces: dict[int, Trace] = {}

    def open(self, slot: int, seed: int, *, start: int = 0) -> None:
        """Open `slot` as conversation `seed` (its input from frame `start`), its prompt
        replayed."""
        self.model.open_slot(slot, self.subject.options(seed))
        self.seed[slot], self.index[slot], self.traces[slot] = seed, start, Trace()
        self.finish_replay(slot)

    def restore(self, slot: int, seed: int, records: Sequence[bytes]) -> None:
        """Restore `slot` as conversation `seed` from the history of `records` (in the
        model's layout), nothing replayed yet."""
        history = self.layout(records)
        self.model.restore_slot(slot, self.subject.options(seed), history)
        model = self.model
        frames = count_records(history, model.state_record_bytes, sized=model.state_records_sized)
        assert frames == len(records)
        self.seed[slot], self.index[slot], self.traces[slot] = seed, frames, Trace()

    def layout(self, records: Sequence[bytes]) -> bytes:
        """A history of `records` in the model's layout."""
        record_bytes, sized = self.model.state_record_bytes, self.model.state_records_sized
        return join_records(list(records), record_bytes, sized=sized)

    def replay(self, slot: int, frames: int) -> int:
        """One `replay_work` call: the frames it took off `replay_pending`."""
        pending = self.model.replay_pending(slot)
        left = self.model.replay_work(slot, frames)
        assert left == self.model.replay_pending(slot) >= 0
        return pending - left

    def finish_replay(self, slot: int) -> None:
        while self.model.replay_pending(slot):
            assert self.replay(slot, self.model.replay_chunk_frames) > 0

    def close(self, slot: int) -> None:
        self.model.close_slot(slot)
        del self.seed[slot], self.index[slot]

    def batch(
        self, slots: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, list[tuple[bytes, ...]] | None]:
        frames = np.zeros((self.model.slots, self.model.frame_samples), np.float32)
        active = np.zeros(self.model.slots, bool)
        images: list[tuple[bytes, ...]] = [()] * self.model.slots
        for slot in slots:
            seed, index = self.seed[slot], self.index[slot]
            frames[slot], active[slot] = self.subject.frame(self.model, slot, seed, index), True
            if self.model.image_input is not None and not self.blind:
                images[slot] = self.subject.images(self.model, slot, seed, index)
        return frames, active, (images if any(images) else None)

    def step(self, slots: Sequence[int]) -> list[FrameOutput | None]:
        """One batched step of `slots` (the others inactive): outputs checked and kept."""
        outputs = self.model.step(*self.batch(slots))
        assert len(outputs) == self.model.slots
        for slot, output in enumerate(outputs):
            if slot not in slots:
                assert output is None, f"inactive slot {slot} gave an output"
                continue
            assert output is not None, f"active slot {slot} gave no output"
            if self.model.state_records_sized:
                assert len(output.record) <= self.model.state_record_bytes
            else:
                assert len(output.record) == self.model.state_record_bytes
            trace = self.traces[slot]
            trace.seen.append(self.subject.observe(self.model, slot, output))
            trace.records.append(output.record)
            self.index[slot] += 1
        return outputs

    def steps(self, slots: Sequence[int], count: int) -> None:
        for _ in range(count):
            self.step(slots)

    def history(self, slot: int) -> list[bytes]:
        """The records of `slot` since it was opened or restored."""
        return list(self.traces[slot].records)


def reference(
    subject: FrameSubject, seed: int, frames: int, *, interrupt_at: int | None = None
) -> Trace:
    """Conversation `seed` alone in a model of one slot for `frames` frames (interrupted
    before frame `interrupt_at`): what it is wherever it runs. Cached on the subject."""
    key = (seed, interrupt_at)
    known = subject.references.get(key)
    if known is None or len(known.seen) < frames:
        run = Run(subject, 1)
        run.open(0, seed)
        for index in range(frames):
            if index == interrupt_at:
                run.model.interrupt_slot(0)
            run.step([0])
        known = subject.references[key] = run.traces[0]
    return Trace(known.seen[:frames], known.records[:frames])


def same(a: Any, b: Any, atol: float) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        return bool(np.array_equal(a, b) if atol == 0 else np.allclose(a, b, rtol=0, atol=atol))
    return bool(a == b)


def assert_same(
    subject: FrameSubject,
    got: Sequence[Observation],
    want: Sequence[Observation],
    what: str,
    may_differ: Mapping[str, int] | None = None,
) -> None:
    """Frame for frame equal (the first `may_differ[name]` frames of a name excepted)."""
    assert len(got) == len(want), f"{what}: {len(got)} frames, not {len(want)}"
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine.keys() == theirs.keys()
        for name, value in theirs.items():
            if may_differ and index < may_differ.get(name, 0):
                continue
            assert same(mine[name], value, subject.atol), (
                f"{what}: frame {index}: {name} {shown(mine[name], value)}"
            )


def shown(mine: Any, theirs: Any) -> str:
    """Two values that differ, briefly (records are kilobytes, audio thousands of samples)."""
    if isinstance(mine, bytes) and isinstance(theirs, bytes):
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
        at = min(len(mine), len(theirs)) if at is None else at
        return (
            f"of {len(mine)} and {len(theirs)} bytes differ from byte {at}: "
            f"{mine[at : at + 8].hex()} != {theirs[at : at + 8].hex()}"
        )
    if isinstance(mine, np.ndarray) or isinstance(theirs, np.ndarray):
        a, b = np.asarray(mine), np.asarray(theirs)
        if a.shape != b.shape:
            return f"shapes {a.shape} != {b.shape}"
        return f"differ by up to {float(np.max(np.abs(a - b))):.3g}"
    return f"{mine!r} != {theirs!r}"


def differ(subject: FrameSubject, a: Sequence[Observation], b: Sequence[Observation]) -> bool:
    return any(
        not same(x[name], y[name], subject.atol) for x, y in zip(a, b, strict=True) for name in x
    )


def uneven(most: int) -> Iterator[int]:
    """Call sizes in 1..`most`, never two alike in a row: 1, most, 2, most - 1, 3, ..."""
    low, high = list(range(1, most + 1)), list(range(most, 0, -1))
    return itertools.cycle(n for pair in zip(low, high, strict=True) for n in pair)


def records_of(trace: Trace, frames: int) -> list[bytes]:
    return trace.records[:frames]


class FrameModelContract:
    """The contract's tests; a subclass's module gives the `subject` fixture."""

    # 1 --------------------------------------------------------------------------------

    def test_a_restored_slot_continues_exactly_as_the_original(self, subject: FrameSubject):
        """Conversation 1's first frames (short, then longer than the context) restored into
        slot 1 while slot 0 is busy (past its context too) and slot 2 opens, replayed in
        uneven chunks with the neighbours stepped between them: slot 1 then goes on as the
        original did, and the neighbours as if alone."""
        if not self._restores(subject):
            return
        after = subject.frames
        assert after > max(subject.restore_may_differ.values(), default=0)
        lengths = [subject.frames]
        if subject.context_frames:
            lengths.append(subject.context_frames + subject.frames)
        for before in lengths:
            original = reference(subject, 1, before + after)
            run = Run(subject, 3)
            run.open(0, 2)
            run.steps([0], (subject.context_frames or 0) + 2)
            run.restore(1, 1, records_of(original, before))
            assert run.model.replay_pending(1) >= before
            with pytest.raises((ValueError, RuntimeError)):  # it replays: not stepped yet
                run.model.step(*run.batch([1]))
            run.open(2, 3)
            sizes, calls = uneven(run.model.replay_chunk_frames), 0
            while run.model.replay_pending(1):
                run.step([0, 2])
                assert run.replay(1, next(sizes)) > 0
                calls += 1
            assert calls > 1 or before <= run.model.replay_chunk_frames
            run.steps([0, 1, 2], after)
            assert_same(
                subject,
                run.traces[1].seen,
                original.seen[before:],
                f"restored after {before} frames",
                subject.restore_may_differ,
            )
            for slot in (0, 2):
                alone = reference(subject, run.seed[slot], run.index[slot])
                assert_same(subject, run.traces[slot].seen, alone.seen, f"neighbour {slot}")

    # 2 --------------------------------------------------------------------------------

    def test_an_interrupt_keeps_the_memory(self, subject: FrameSubject):
        """Interrupted before frame `at`: it stops something (not the uninterrupted run),
        forgets nothing (not a fresh conversation from `at` on), and a restore of its
        history past the interrupt continues as it did."""
        at, total = subject.frames, 2 * subject.frames + 2
        plain = reference(subject, 1, total)
        cut = reference(subject, 1, total, interrupt_at=at)
        assert_same(subject, cut.seen[:at], plain.seen[:at], "before the interrupt")
        assert differ(subject, cut.seen[at:], plain.seen[at:]), "the interrupt changed nothing"
        fresh = Run(subject, 1)
        fresh.open(0, 1, start=at)
        fresh.steps([0], total - at)
        assert differ(subject, cut.seen[at:], fresh.traces[0].seen), (
            "after the interrupt the slot is a fresh conversation: it forgot its history"
        )
        if not self._restores(subject):
            return
        if subject.interrupt_in_records:
            assert cut.records[at:] != plain.records[at:], (
                "no record after the interrupt says it: a restore would not interrupt"
            )
        else:  # its records say nothing of it, by design (interrupt_in_records_why)
            assert cut.records == plain.records
        upto = at + 2
        run = Run(subject, 2)
        run.open(0, 2)
        run.restore(1, 1, records_of(cut, upto))
        sizes = uneven(run.model.replay_chunk_frames)
        while run.model.replay_pending(1):
            run.step([0])
            run.replay(1, next(sizes))
        run.steps([0, 1], total - upto)
        assert_same(
            subject,
            run.traces[1].seen,
            cut.seen[upto:],
            "restored past the interrupt",
            subject.restore_may_differ,
        )

    # 3 --------------------------------------------------------------------------------

    def test_slots_are_isolated(self, subject: FrameSubject):
        """Three conversations joining at different frames, one interrupted, closed and
        reopened, one left inactive for a while: each open one's outputs are its
        reference's, and the inactive one goes on as if those steps had not happened."""
        n = subject.frames
        assert differ(subject, reference(subject, 1, n).seen, reference(subject, 2, n).seen), (
            "conversations 1 and 2 look the same: the subject's comparisons would say nothing"
        )
        run = Run(subject, 3)
        run.open(0, 1)
        run.steps([0], 2)
        run.open(2, 3)
        run.steps([0, 2], 2)
        run.open(1, 2)
        run.steps([0, 1, 2], 2)
        run.model.interrupt_slot(2)
        run.steps([0, 1, 2], 2)
        run.steps([1, 2], 3)  # slot 0 inactive
        run.close(2)
        run.steps([0, 1], 2)
        run.open(2, 4)
        run.steps([0, 1, 2], n)
        for slot in (0, 1, 2):
            alone = reference(subject, run.seed[slot], run.index[slot])
            assert_same(subject, run.traces[slot].seen, alone.seen, f"slot {slot}")

    # 4 --------------------------------------------------------------------------------

    def test_a_failed_step_hands_over_its_records(self, subject: FrameSubject):
        """A step that fails after the model advanced raises FrameStepError with the
        frame's records of the slots it stepped (None for the others): the history with
        them restores elsewhere and goes on as the conversation would have."""
        k, n = subject.frames, subject.frames
        run = Run(subject, 3)
        run.open(0, 1)
        run.open(1, 2)
        run.steps([0, 1], k)
        how = subject.fail_next_step(run.model)
        if how is None:  # it cannot fail after advancing: it has no records to hand over
            assert run.model.state_record_bytes == 0
            assert all(r == b"" for slot in (0, 1) for r in run.traces[slot].records)
            return
        assert how in ("advanced", "before")
        with pytest.raises(Exception) as failed:  # whatever the model raises
            run.step([0, 1])
        if how == "before":  # nothing advanced: the slots go on from frame k
            assert not isinstance(failed.value, FrameStepError)
            run.steps([0, 1], n)
            for slot in (0, 1):
                alone = reference(subject, run.seed[slot], k + n)
                assert_same(subject, run.traces[slot].seen, alone.seen, f"slot {slot}")
            return
        assert isinstance(failed.value, FrameStepError)
        records = failed.value.records
        assert len(records) == 3 and records[2] is None
        for slot in (0, 1):
            alone = reference(subject, run.seed[slot], k + 1 + n)
            assert records[slot] == alone.records[k], f"slot {slot}: not the frame's record"
            other = Run(subject, 1)
            other.restore(0, run.seed[slot], [*run.history(slot), records[slot]])
            other.finish_replay(0)
            other.steps([0], n)
            assert_same(
                subject,
                other.traces[0].seen,
                alone.seen[k + 1 :],
                f"slot {slot} restored with the failed frame's record",
                subject.restore_may_differ,
            )

    # 5 --------------------------------------------------------------------------------

    def test_a_second_open_of_a_slot_is_a_fresh_conversation(self, subject: FrameSubject):
        """Open, step, interrupt, close, open again (the same conversation, beside a busy
        neighbour): the second is a fresh model's, frame for frame."""
        n = subject.frames
        run = Run(subject, 2)
        run.open(0, 1)
        run.open(1, 2)
        run.steps([0, 1], n)
        run.model.interrupt_slot(0)
        run.steps([0, 1], 2)
        run.close(0)
        run.steps([1], 2)
        run.open(0, 1)
        run.steps([0, 1], n)
        assert_same(subject, run.traces[0].seen, reference(subject, 1, n).seen, "reopened")
        alone = reference(subject, 2, run.index[1])
        assert_same(subject, run.traces[1].seen, alone.seen, "its neighbour")

    # 6 --------------------------------------------------------------------------------

    def test_replay_work_takes_exactly_the_frames_asked(self, subject: FrameSubject):
        """Every n in 1..replay_chunk_frames takes min(n, pending) frames and returns what
        is left; n outside is refused and takes nothing; a prompt in one piece is taken
        whole by the first call."""
        run = Run(subject, 2)
        model = run.model
        most = model.replay_chunk_frames
        assert most >= 1
        if not self._restores(subject):
            return
        history_frames = most * (most + 1) // 2 + 2
        original = reference(subject, 1, history_frames)
        run.restore(1, 1, records_of(original, history_frames))
        prompt = model.replay_pending(1) - history_frames
        assert prompt >= 0
        for bad in (0, -1, most + 1):
            with pytest.raises(ValueError):
                model.replay_work(1, bad)
            assert model.replay_pending(1) == history_frames + prompt
        if prompt and subject.prompt_in_one_piece:
            assert run.replay(1, 1) == prompt  # the prompt is one forward
        fewer = False

        def replay(frames: int) -> None:
            nonlocal fewer
            pending = model.replay_pending(1)
            fewer |= frames > pending
            assert run.replay(1, frames) == min(frames, pending), f"asked for {frames}"

        for frames in range(1, most + 1):  # every size (their sum is all but 2 of the history)
            replay(frames)
        if model.replay_pending(1) % most == 0:
            replay(1)
        while model.replay_pending(1):  # the last call finds fewer left than it asks for
            replay(most)
        assert fewer or most == 1
        assert model.replay_work(1, most) == 0  # nothing left: nothing taken
        run.step([1])  # done: it steps

    # 7 --------------------------------------------------------------------------------

    def test_a_model_that_takes_images_sees_them_with_their_frame(self, subject: FrameSubject):
        """With a camera, a conversation goes as without one until the first frame that
        carries an image, and differs from there on (the model saw it); a model that takes
        no images is never given any."""
        n = subject.frames
        probe = Run(subject, 1)
        if probe.model.image_input is None:
            probe.open(0, 1)
            assert probe.batch([0])[2] is None  # the suite passes it none
            return
        first = next((i for i in range(n) if subject.images(probe.model, 0, 1, i)), None)
        assert first is not None, "the subject's conversation 1 has no image in its frames"
        seeing = reference(subject, 1, n)
        blind = Run(subject, 1, blind=True)
        blind.open(0, 1)
        blind.steps([0], n)
        assert_same(subject, seeing.seen[:first], blind.traces[0].seen[:first], "before it")
        assert differ(subject, seeing.seen[first:], blind.traces[0].seen[first:]), (
            "the images changed nothing: the model did not see them"
        )

    # ----------------------------------------------------------------------------------

    @staticmethod
    def _restores(subject: FrameSubject) -> bool:
        """Whether the model exports its state; where it does not, what it does instead: it
        refuses a restore, and an open slot has nothing to replay."""
        if subject.restores:  # known (a model is not built to ask again)
            return True
        run = Run(subject, 1)
        if run.model.state_record_bytes:
            subject.restores = True
            return True
        assert not run.model.state_records_sized  # sized records of no size
        with pytest.raises(NotImplementedError):
            run.model.restore_slot(0, subject.options(1), b"")
        run.open(0, 1)
        assert run.model.replay_pending(0) == 0
        run.step([0])
        assert run.traces[0].records == [b""]
        return False
