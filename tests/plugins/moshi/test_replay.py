"""A Moshi slot's memory: the records of its frames rebuild it exactly, elsewhere.

The LM's state is what a restore rebuilds (plugins/moshi/replay.py); Mimi's encoder starts
afresh at a restore, so the user codes it makes of the same audio differ for a few frames.
These tests therefore give the LM the user's codes directly (`Codes` replaces Mimi's
encoder with a per-slot script of codes), and compare the tokens the LM then produces:
greedy, they must be equal to an uninterrupted run's, token for token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.plugins.moshi.conftest import user_audio

CONTEXT = 100  # the tiny LM's context (harness/tiny_moshi.py)


class Codes:
    """Mimi's encoder replaced: each slot's next codes from its script (zeros when none)."""

    def __init__(self, model, scripts: dict[int, np.ndarray]) -> None:
        self.model = model
        self.scripts = scripts
        self.cursor = {slot: 0 for slot in scripts}
        self.real = model.mimi.encode
        model.mimi.encode = self

    def __call__(self, audio: torch.Tensor) -> torch.Tensor:
        real = self.real(audio)  # keeps Mimi's streaming state moving as it would
        out = torch.zeros_like(real)
        for slot, script in self.scripts.items():
            if self.model.is_stepping(slot):
                at = self.cursor[slot]
                out[slot, : script.shape[1], 0] = torch.from_numpy(script[at])
        return out

    def advance(self, active: np.ndarray) -> None:
        for slot in self.scripts:
            if active[slot]:
                self.cursor[slot] += 1


def script(seed: int, frames: int, codebooks: int = 2, card: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, card, size=(frames, codebooks))


def step(model, codes: Codes, active_slots: list[int]):
    frames = np.zeros((model.slots, model.frame_samples), np.float32)
    active = np.zeros(model.slots, bool)
    active[active_slots] = True
    outputs = model.step(frames, active)
    codes.advance(active)
    return outputs


def run_alone(make_model, seed: int, frames: int) -> tuple[bytes, list[np.ndarray]]:
    """One slot stepped `frames` times on its script: its history and tokens per frame."""
    model = make_model(1)
    model.open_slot(0, {})
    codes = Codes(model, {0: script(seed, frames)})
    history, tokens = b"", []
    for _ in range(frames):
        output = step(model, codes, [0])[0]
        history += output.record
        tokens.append(model.last_tokens[0].copy())
    return history, tokens


@pytest.mark.parametrize(
    "frames_before, calls",
    [(40, [16]), (260, [16]), (260, [1, 16, 7, 3, 12])],
    ids=["below-context", "past-context", "past-context-uneven-calls"],
)
def test_a_restored_slot_goes_on_as_if_never_moved_beside_a_wrapped_neighbour(
    make_model, frames_before, calls
):
    """K frames (below and past the context), restored in another model's slot 1 while
    slot 0 is busy and its ring has wrapped, `replay_work` asked for the frames of `calls`
    in turn (the stage sizes each call to its tick's spare time): each call replays exactly
    the frames it is asked for, the next frames are the uninterrupted run's, and the
    neighbour's are its own as if alone."""
    after = 25
    total = frames_before + after
    history, reference = run_alone(make_model, seed=1, frames=total)
    record_bytes = len(history) // total
    neighbour_frames = CONTEXT + 40 + total
    _, neighbour_alone = run_alone(make_model, seed=2, frames=neighbour_frames)

    model = make_model(2, replay_chunk_frames="16")
    model.open_slot(0, {})
    session = script(1, total)
    codes = Codes(model, {0: script(2, neighbour_frames), 1: session[frames_before:]})
    neighbour = []
    for _ in range(CONTEXT + 40):  # the neighbour's ring wraps before the restore
        step(model, codes, [0])
        neighbour.append(model.last_tokens[0].copy())
    model.restore_slot(1, {}, history[: frames_before * record_bytes])
    assert model.replay_pending(1) == frames_before
    with pytest.raises(ValueError, match="replaying"):
        step(model, codes, [0, 1])
    chunks = 0
    while pending := model.replay_pending(1):  # a call between steps, the neighbour on
        step(model, codes, [0])
        neighbour.append(model.last_tokens[0].copy())
        asked = calls[chunks % len(calls)]
        assert model.replay_work(1, asked) == pending - min(asked, pending)
        assert model.replay_pending(1) == pending - min(asked, pending)
        chunks += 1
    if calls == [16]:
        assert chunks == -(-frames_before // 16)
    restored = []
    for _ in range(after):
        step(model, codes, [0, 1])
        neighbour.append(model.last_tokens[0].copy())
        restored.append(model.last_tokens[1].copy())
    for index, (mine, theirs) in enumerate(zip(restored, reference[frames_before:], strict=True)):
        assert np.array_equal(mine, theirs), f"frame {frames_before + index}: {mine} != {theirs}"
    for index, (mine, theirs) in enumerate(zip(neighbour, neighbour_alone, strict=False)):
        assert np.array_equal(mine, theirs), f"neighbour frame {index}: {mine} != {theirs}"


def test_the_records_are_what_the_lm_was_fed(make_model):
    """A slot's history is whole records, one per active step, of the LM's codebooks and
    the barge-in's silence."""
    model = make_model(2)
    model.open_slot(0, {})
    model.open_slot(1, {})
    audio = user_audio(3, 6)
    history = b""
    for frame in audio:
        frames = np.zeros((2, model.frame_samples), np.float32)
        frames[0] = frame
        output = model.step(frames, np.array([True, False]))[0]
        history += output.record
    assert model.state_record_bytes == 2 * (model.lm.num_codebooks + 1)
    assert len(history) == 6 * model.state_record_bytes
    records = np.frombuffer(history, "<u2").reshape(6, -1)
    assert (records[:, 0] < model.lm.text_card + 1).all()
    assert (records[:, -1] == 0).all()  # no barge-in: no silence


def test_a_barge_in_keeps_the_context(make_model):
    """After an interrupt the slot is silent for its interrupt frames and then goes on
    from its history: its next tokens are those of a run that spoke and was silenced at
    the same frame, not those of a fresh open; and a reopen (for contrast) forgets."""
    before, after = 30, 20
    codes_script = script(4, before + after)

    def run(action):
        model = make_model(1, interrupt_frames="3")
        model.open_slot(0, {})
        codes = Codes(model, {0: codes_script})
        tokens, outputs = [], []
        for index in range(before + after):
            if index == before:
                action(model)
            outputs.append(step(model, codes, [0])[0])
            tokens.append(model.last_tokens[0].copy())
        return model, tokens, outputs

    model, interrupted, outputs = run(lambda m: m.interrupt_slot(0))
    records = np.frombuffer(b"".join(o.record for o in outputs), "<u2").reshape(before + after, -1)
    # the silenced frames: text forced to padding, audio to the codes of silence
    padding = model.lm.text_padding_token_id
    assert (records[before : before + 3, 0] == padding).all()
    assert [tuple(r) for r in records[before : before + 3, 1 : 1 + model.lm.dep_q]] == [
        model.silence_codes
    ] * 3
    assert not any(o.speaking for o in outputs[before : before + 3])
    # the context is kept: the slot's offset went on, a reopened slot's starts over
    state = model.lm_gen._streaming_state
    assert int(state.offsets[0]) == before + after

    def reopen(m) -> None:
        m.close_slot(0)
        m.open_slot(0, {})

    reset_model, reset, _ = run(reopen)
    assert int(reset_model.lm_gen._streaming_state.offsets[0]) == after
    # the same frames before the barge-in; after it, the reopened slot (a fresh
    # conversation, for contrast) and the interrupted one (its history in context) part ways
    assert all(
        np.array_equal(a, b) for a, b in zip(interrupted[:before], reset[:before], strict=True)
    )
    later = zip(interrupted[before + 3 :], reset[before + 3 :], strict=True)
    assert not all(np.array_equal(a, b) for a, b in later)


def run_interrupted(make_model, seed: int, frames: int, at: int | None, hold: int = 2):
    """One slot stepped `frames` times on its script, interrupted before frame `at` (None:
    never), its speaking hold `hold` frames: its history and, per frame, its output
    (tokens, words, speaking, record)."""
    model = make_model(1, interrupt_frames="3")
    model.speaking_hold_frames = hold
    model.open_slot(0, {})
    codes = Codes(model, {0: script(seed, frames)})
    history, seen = b"", []
    for index in range(frames):
        if index == at:
            model.interrupt_slot(0)
        output = step(model, codes, [0])[0]
        history += output.record
        seen.append((model.last_tokens[0].tolist(), output.text, output.speaking, output.record))
    return history, seen


def restored_run(
    make_model, seed: int, frames: int, history: bytes, upto: int, at: int, hold: int = 2
):
    """A slot of another model restored from the first `upto` records of `history` (a
    neighbour busy beside it), then stepped on to `frames` (interrupted before frame `at`
    if it is still to come): its outputs as run_interrupted's."""
    model = make_model(2, interrupt_frames="3", replay_chunk_frames="7")
    model.speaking_hold_frames = hold
    model.open_slot(0, {})
    codes = Codes(model, {0: script(seed + 100, frames + upto), 1: script(seed, frames)[upto:]})
    record = model.state_record_bytes
    model.restore_slot(1, {}, history[: upto * record])
    while model.replay_pending(1):
        step(model, codes, [0])
        model.replay_work(1, 7)
    seen = []
    for index in range(upto, frames):
        if index == at:
            model.interrupt_slot(1)
        output = step(model, codes, [0, 1])[1]
        seen.append((model.last_tokens[1].tolist(), output.text, output.speaking, output.record))
    return model, seen


def test_a_restore_inside_a_barge_ins_silence_stays_silent_for_the_rest(make_model):
    """A history that ends inside a barge-in's silence (3 frames here) says how much of it
    is left (each record's last field): the restored slot stays silent for exactly those
    frames (text padding, the codes of silence, not speaking), then goes on as the original,
    token for token, word for word; so does one restored just after the silence."""
    at, frames = 20, 34
    history, original = run_interrupted(make_model, seed=11, frames=frames, at=at)
    _, plain = run_interrupted(make_model, seed=11, frames=frames, at=None)
    assert [s[0] for s in original[at:]] != [s[0] for s in plain[at:]], "a barge-in did nothing"
    silence = np.frombuffer(history, "<u2").reshape(frames, -1)[:, -1]
    assert silence[at - 2 : at + 5].tolist() == [0, 0, 3, 2, 1, 0, 0]
    for upto in (at + 1, at + 2, at + 3, at + 4):
        model, seen = restored_run(make_model, 11, frames, history, upto, at)
        left = max(0, at + 3 - upto)
        records = np.frombuffer(b"".join(s[3] for s in seen), "<u2").reshape(len(seen), -1)
        assert records[:left, 0].tolist() == [model.lm.text_padding_token_id] * left
        assert all(tuple(r) == model.silence_codes for r in records[:left, 1 : 1 + model.lm.dep_q])
        assert not any(s[2] for s in seen[:left])
        for index, (mine, theirs) in enumerate(zip(seen, original[upto:], strict=True)):
            assert mine == theirs, f"restored at {upto}: frame {upto + index}"


def test_a_restore_keeps_the_speaking_hold(make_model):
    """Whether the slot is speaking (its last word at most `speaking_hold_frames` ago)
    after a restore at any frame is the original's: the words a step outputs are the text
    token of the step before (LMGen's delay), a barge-in's silence puts it past the hold."""
    frames, hold, at = 40, 1, 24
    history, original = run_interrupted(make_model, seed=1, frames=frames, at=at, hold=hold)
    assert len({s[2] for s in original}) == 2 and any(not s[1] for s in original[3:])
    for upto in range(2, frames - 3):
        _, seen = restored_run(make_model, 1, upto + 3, history, upto, at, hold=hold)
        assert [s[2] for s in seen] == [s[2] for s in original[upto : upto + 3]], (
            f"restored at {upto}"
        )


def test_a_history_restored_mid_prompt_steps_the_rest_of_the_prompt(make_model):
    """A restore replays what was stepped and leaves the rest of the prompt to step."""
    model = make_model(1)
    from plugins.moshi.frame_model import PromptFrame

    prompt = [PromptFrame((1, 2), text_token=5, model_codes=(3, 4)) for _ in range(6)]
    model.prompt_builder = lambda options: prompt
    model.open_slot(0, {})
    history = b""
    zeros = np.zeros((1, model.frame_samples), np.float32)
    for _ in range(4):
        history += model.step(zeros, np.array([True]))[0].record
    other = make_model(1)
    other.prompt_builder = lambda options: prompt
    other.restore_slot(0, {}, history)
    while other.replay_pending(0):
        other.replay_work(0, other.replay_chunk_frames)
    assert other.prompt_frames_left(0) == 2
    assert model.prompt_frames_left(0) == 2


def test_a_history_of_broken_records_is_refused(make_model):
    model = make_model(1)
    with pytest.raises(ValueError, match="records"):
        model.restore_slot(0, {}, b"\x01\x02\x03")


@pytest.mark.parametrize("frames", [29, 30], ids=["not-whole", "whole-by-chance"])
def test_an_earlier_versions_history_is_refused(make_model, frames):
    """A history of the records before the silence field (the tokens alone: 10 bytes a
    frame for the tiny LM) is refused, not replayed: in most lengths its bytes are not whole
    records; where they are (every 6th length here), they are not this model's records."""
    history, _ = run_interrupted(make_model, seed=12, frames=frames, at=10)
    old = np.frombuffer(history, "<u2").reshape(frames, -1)[:, :-1].astype("<u2").tobytes()
    model = make_model(1)
    with pytest.raises(ValueError, match="records"):
        model.restore_slot(0, {}, old)
    assert not model.is_stepping(0) and model.replay_pending(0) == 0


def test_a_restored_slots_decoder_is_warmed_and_its_first_step_keeps_it(make_model, monkeypatch):
    """The decoder warmed on the history's last frames is still warm at the slot's first
    step (only Mimi's encoder starts over there): the first audio differs from a cold
    decoder's."""
    import plugins.moshi.frame_model as frame_model

    history, _ = run_alone(make_model, seed=5, frames=30)

    def first_audio(warm_frames: int) -> np.ndarray:
        monkeypatch.setattr(frame_model, "DECODER_WARM_FRAMES", warm_frames)
        model = make_model(1)
        codes = Codes(model, {0: script(6, 5)})
        model.restore_slot(0, {}, history)
        while model.replay_pending(0):
            model.replay_work(0, model.replay_chunk_frames)
        output = step(model, codes, [0])[0]
        assert output.audio.size
        return output.audio

    assert not np.allclose(first_audio(4), first_audio(0))


def test_a_step_that_fails_after_the_lm_advanced_still_gives_the_records(make_model):
    """Mimi's decode raising after the LM stepped: the error carries the frame's records
    of the active slots (the stage appends them), none for the inactive ones."""
    from shared.contracts import FrameStepError

    model = make_model(2)
    model.open_slot(0, {})
    codes = Codes(model, {0: script(7, 10)})
    for _ in range(5):
        step(model, codes, [0])

    def broken(tokens):
        raise RuntimeError("out of memory")

    model.mimi.decode = broken
    with pytest.raises(FrameStepError) as failed:
        step(model, codes, [0])
    assert int(model.lm_gen._streaming_state.offsets[0]) == 6
    record, other = failed.value.records
    assert len(record) == model.state_record_bytes and other is None


def test_a_replay_that_fails_leaves_the_shared_batch_as_it_was(make_model):
    """The side batch cannot be made (out of memory, say): the replay fails, and the
    other slots step on, exactly as before."""
    history, _ = run_alone(make_model, seed=8, frames=20)
    _, alone = run_alone(make_model, seed=9, frames=6)
    model = make_model(2)
    model.open_slot(0, {})
    codes = Codes(model, {0: script(9, 6)})
    tokens = []
    for _ in range(3):
        step(model, codes, [0])
        tokens.append(model.last_tokens[0].copy())
    model.restore_slot(1, {}, history)

    def no_memory(batch_size: int):
        raise RuntimeError("out of memory")

    model.lm.streaming = no_memory
    with pytest.raises(RuntimeError, match="out of memory"):
        model.replay_work(1, model.replay_chunk_frames)
    for _ in range(3):
        step(model, codes, [0])
        tokens.append(model.last_tokens[0].copy())
    assert all(np.array_equal(a, b) for a, b in zip(tokens, alone, strict=True))


def test_a_replay_call_takes_1_to_replay_chunk_frames_frames(make_model):
    """`replay_work` refuses a call of no frames or of more than `replay_chunk_frames` (what
    the side replay's rings are sized for) and replays nothing then; a call for more than
    are left replays what is left."""
    history, _ = run_alone(make_model, seed=10, frames=20)
    model = make_model(1, replay_chunk_frames="16")
    assert model.replay_chunk_frames == 16
    model.restore_slot(0, {}, history)
    for frames in (0, -1, 17):
        with pytest.raises(ValueError, match=r"1\.\.16 frames"):
            model.replay_work(0, frames)
    assert model.replay_pending(0) == 20
    assert model.replay_work(0, 16) == 4
    assert model.replay_work(0, 16) == 0 and model.is_stepping(0)
    assert model.replay_work(0, 1) == 0  # nothing pending: nothing to do
    model.close_slot(0)
    assert not model.is_stepping(0) and model.replay_pending(0) == 0
