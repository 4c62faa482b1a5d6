"""MoshiFrameModel's batching: a slot's outputs are the same whoever shares the batch.

Tokens must be equal. Audio is compared with a tight tolerance rather than bitwise: Mimi's
decoder runs on the whole batch, and a float32 convolution or matmul over a different batch
size may pick a different CPU kernel (blocking), which can change the last bits.
"""

from collections.abc import Mapping

import numpy as np
import pytest

from tests.plugins.moshi.conftest import user_audio

FRAMES = 10
ATOL = 1e-5


class Trace:
    """What one slot produced, frame by frame (its active frames only)."""

    def __init__(self) -> None:
        self.tokens: list[np.ndarray] = []
        self.texts: list[str] = []
        self.audio: list[np.ndarray] = []

    def assert_same(self, other: "Trace") -> None:
        assert len(self.tokens) == len(other.tokens)
        for index, (mine, theirs) in enumerate(zip(self.tokens, other.tokens, strict=True)):
            assert np.array_equal(mine, theirs), f"frame {index}: tokens {mine} != {theirs}"
        assert self.texts == other.texts
        for mine, theirs in zip(self.audio, other.audio, strict=True):
            assert mine.shape == theirs.shape
            np.testing.assert_allclose(mine, theirs, atol=ATOL, rtol=0)


def run(model, schedule: list[Mapping[int, np.ndarray]]) -> dict[int, Trace]:
    """Step `model` once per entry of `schedule` (slot -> its input frame; absent: inactive)."""
    traces: dict[int, Trace] = {}
    for inputs in schedule:
        frames = np.zeros((model.slots, model.frame_samples), dtype=np.float32)
        active = np.zeros(model.slots, dtype=bool)
        for slot, frame in inputs.items():
            frames[slot], active[slot] = frame, True
        outputs = model.step(frames, active)
        for slot in range(model.slots):
            if not active[slot]:
                assert outputs[slot] is None
                continue
            trace = traces.setdefault(slot, Trace())
            trace.tokens.append(model.last_tokens[slot].copy())
            trace.texts.append(outputs[slot].text)
            trace.audio.append(outputs[slot].audio)
    return traces


def alone(make_model, audio: np.ndarray) -> Trace:
    """One slot's outputs in a model of one slot."""
    model = make_model(1)
    model.open_slot(0, {})
    return run(model, [{0: frame} for frame in audio])[0]


@pytest.fixture(scope="module")
def inputs():
    return {slot: user_audio(100 + slot, FRAMES) for slot in range(4)}


def test_batch_of_four_equals_each_alone(make_model, inputs):
    model = make_model(4)
    for slot in range(4):
        model.open_slot(slot, {})
    batched = run(model, [{s: inputs[s][t] for s in range(4)} for t in range(FRAMES)])
    for slot in range(4):
        reference = alone(make_model, inputs[slot])
        batched[slot].assert_same(reference)
    # the slots really differ (the comparison above is not between identical streams)
    assert not all(
        np.array_equal(a, b) for a, b in zip(batched[0].tokens, batched[1].tokens, strict=True)
    )
    # the model speaks: audio frames after its acoustic delay, words on some frames
    assert batched[0].audio[0].size == 0 and batched[0].audio[-1].shape == (1920,)
    assert any(batched[0].texts)


def test_slot_alone_in_a_bigger_batch_equals_a_batch_of_one(make_model, inputs):
    model = make_model(4)
    model.open_slot(2, {})
    traces = run(model, [{2: frame} for frame in inputs[2]])
    traces[2].assert_same(alone(make_model, inputs[2]))


def test_opening_and_closing_others_mid_stream_does_not_change_a_slot(make_model, inputs):
    model = make_model(3)
    model.open_slot(0, {})
    model.open_slot(1, {})
    schedule = []
    for t in range(FRAMES):
        step = {0: inputs[0][t]}
        if t < 6:
            step[1] = inputs[1][t]
        if t >= 3:
            step[2] = inputs[2][t - 3]
        schedule.append(step)
    # the schedule's opens and closes happen between steps: run it in three pieces
    first = run(model, schedule[:3])
    model.open_slot(2, {})
    second = run(model, schedule[3:6])
    model.close_slot(1)
    third = run(model, schedule[6:])
    trace0 = Trace()
    for piece in (first, second, third):
        trace0.tokens += piece[0].tokens
        trace0.texts += piece[0].texts
        trace0.audio += piece[0].audio
    trace0.assert_same(alone(make_model, inputs[0]))
    # the slot opened mid-stream is a fresh conversation: as if alone from its first frame
    trace2 = Trace()
    for piece in (second, third):
        trace2.tokens += piece[2].tokens
        trace2.texts += piece[2].texts
        trace2.audio += piece[2].audio
    trace2.assert_same(alone(make_model, inputs[2][: FRAMES - 3]))


def test_a_slot_closed_and_opened_again_restarts_that_slot_only(make_model, inputs):
    model = make_model(2)
    model.open_slot(0, {})
    model.open_slot(1, {})
    before = run(model, [{0: inputs[0][t], 1: inputs[1][t]} for t in range(5)])
    model.close_slot(1)  # slot 1's session ends, and another takes the slot
    model.open_slot(1, {})
    after = run(model, [{0: inputs[0][t], 1: inputs[2][t - 5]} for t in range(5, FRAMES)])
    # slot 0 never noticed
    trace0 = Trace()
    trace0.tokens = before[0].tokens + after[0].tokens
    trace0.texts = before[0].texts + after[0].texts
    trace0.audio = before[0].audio + after[0].audio
    trace0.assert_same(alone(make_model, inputs[0]))
    # slot 1 opened again is a fresh slot fed the same frames
    after[1].assert_same(alone(make_model, inputs[2][: FRAMES - 5]))
    # and not what it would have said had it gone on
    unreset = alone(make_model, np.concatenate([inputs[1][:5], inputs[2][: FRAMES - 5]]))
    assert any(
        not np.array_equal(a, b) for a, b in zip(after[1].tokens, unreset.tokens[5:], strict=True)
    )


def test_inactive_slots_do_not_advance(make_model, inputs):
    model = make_model(2)
    model.open_slot(0, {})
    model.open_slot(1, {})
    # slot 1 is inactive on frames 3..6 (its client is gone for a while): it must resume
    # exactly where it was, as if those steps had never happened
    schedule = []
    for t in range(FRAMES):
        step = {0: inputs[0][t]}
        if not 3 <= t <= 6:
            step[1] = inputs[1][t]
        schedule.append(step)
    traces = run(model, schedule)
    traces[0].assert_same(alone(make_model, inputs[0]))
    kept = [t for t in range(FRAMES) if not 3 <= t <= 6]
    traces[1].assert_same(alone(make_model, inputs[1][kept]))


def test_no_active_slot_steps_nothing(make_model):
    model = make_model(2)
    model.open_slot(0, {})
    zeros = np.zeros((2, model.frame_samples), dtype=np.float32)
    assert model.step(zeros, np.zeros(2, dtype=bool)) == [None, None]


def test_step_refuses_a_slot_not_opened_and_bad_shapes(make_model):
    model = make_model(2)
    model.open_slot(0, {})
    zeros = np.zeros((2, model.frame_samples), dtype=np.float32)
    with pytest.raises(ValueError, match="not open"):
        model.step(zeros, np.array([True, True]))
    with pytest.raises(ValueError, match="frames"):
        model.step(zeros[:, :100], np.array([True, False]))
    with pytest.raises(IndexError):
        model.open_slot(2, {})
    with pytest.raises(ValueError, match="not open"):
        model.interrupt_slot(1)
    assert model.is_stepping(0) and not model.is_stepping(1)


def test_speaking_follows_the_text_stream(make_model, inputs):
    """Words make a speaking frame; a model whose text is all padding never speaks, though
    Moshi always outputs audio (its silence is audio too)."""
    model = make_model(1)
    model.open_slot(0, {})
    speaking = []
    for frame in inputs[0]:
        (output,) = model.step(frame[None], np.array([True]))
        speaking.append((output.text != "", output.speaking))
    assert any(said and speaks for said, speaks in speaking)
    assert all(speaks for said, speaks in speaking if said)

    quiet = make_model(1)
    # zero text logits: argmax is token 0, moshi's end-of-padding: no words, ever
    quiet.lm.text_linear.weight.data.zero_()
    quiet.open_slot(0, {})
    for frame in inputs[0]:
        (output,) = quiet.step(frame[None], np.array([True]))
        assert output.text == "" and not output.speaking
    assert output.audio.shape == (1920,)


def test_speaking_holds_for_a_few_frames_after_a_word(make_model, inputs):
    model = make_model(1)
    hold = model.speaking_hold_frames
    assert hold >= 1
    pad = model.lm.text_padding_token_id
    assert model.words(pad) == "" and model.words(model.lm.end_of_text_padding_id) == ""
    word = next(t for t in range(model.tokenizer.vocab_size()) if model.words(t).strip())
    assert model.words(word) == model.tokenizer.id_to_piece(word).replace("\u2581", " ")
    # words on frames 2 and 8 only (the rest padding): speaking on 2..2+hold and 8..8+hold
    said = {2, 8}
    frame_index = iter(range(100))
    model.words = lambda token: "w" if next(frame_index) in said else ""
    model.open_slot(0, {})
    speaking = []
    for frame in inputs[0]:
        (output,) = model.step(frame[None], np.array([True]))
        if output.audio.size:
            speaking.append(output.speaking)
    expected = [any(0 <= t - s <= hold for s in said) for t in range(len(speaking))]
    assert speaking == expected
