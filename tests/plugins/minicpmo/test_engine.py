"""The unit engine on the tiny checkpoint: a session's outcomes do not depend on who shares
its batch or when they joined; a slot restored from its records goes on exactly as the
original does (greedy and sampled); the records say what was fed."""

import itertools

import numpy as np
import pytest

from plugins.minicpmo.duplex_loop import ContextWindow
from plugins.minicpmo.engine import EngineSettings, UnitEngine, UnitRequest
from plugins.minicpmo.records import UnitRecord
from plugins.minicpmo.text_sampling import TextSampling
from plugins.minicpmo.vocoder import ToneDecoder
from tests.plugins.minicpmo.golden import scenarios


def engine(weights, *, greedy=True, slots=2, window=None):
    return UnitEngine(
        weights,
        ToneDecoder(),
        EngineSettings(
            slots=slots,
            window=window or ContextWindow(high=4000, low=3000),
            sampling=TextSampling(greedy=greedy),
            speech_greedy=greedy,
        ),
    )


def summary(outcome):
    return (outcome.listen, tuple(outcome.fed), tuple(outcome.codes), outcome.text)


def run_alone(weights, scenario, *, greedy=True, seed=7):
    e = engine(weights, greedy=greedy, slots=1)
    e.open(0, e.prompt(scenario.prefix, scenario.suffix), seed=seed)
    return [e.step([UnitRequest(0, u.audio, u.frames)])[0] for u in scenario.units]


def test_a_session_says_the_same_whoever_joins_its_batch_and_when(tiny_weights):
    camera, short = scenarios.camera(), scenarios.audio_short()
    alone_camera = [summary(o) for o in run_alone(tiny_weights, camera)]
    alone_short = [summary(o) for o in run_alone(tiny_weights, short)]
    e = engine(tiny_weights)
    e.open(1, e.prompt(camera.prefix, camera.suffix), seed=7)
    together_camera, together_short = [], []
    join = 3
    for index, unit in enumerate(camera.units):
        requests = [UnitRequest(1, unit.audio, unit.frames)]
        if index == join:
            e.open(0, e.prompt(short.prefix, short.suffix), seed=7)
        if index >= join and index - join < len(short.units):
            requests.append(UnitRequest(0, short.units[index - join].audio))
        outcomes = e.step(requests)
        together_camera.append(summary(outcomes[0]))
        together_short += [summary(o) for o in outcomes[1:]]
    assert together_camera == alone_camera
    assert together_short == alone_short[: len(together_short)]


@pytest.mark.parametrize("greedy", [True, False])
def test_a_restored_slot_goes_on_as_the_original_does(tiny_weights, greedy):
    scenario = scenarios.camera()
    original = run_alone(tiny_weights, scenario, greedy=greedy)
    cut = 6
    records = [UnitRecord.decode(o.record.encode()) for o in original[:cut]]
    e = engine(tiny_weights, greedy=greedy)
    # slot 0 is busy with another session meanwhile: the restore is slot 1's own
    other = scenarios.audio_short()
    e.open(0, e.prompt(other.prefix, other.suffix), seed=3)
    e.begin_restore(1, e.prompt(scenario.prefix, scenario.suffix), seed=7, records=records)
    assert e.replay_left(1) == cut
    left = e.replay(1, 4)
    e.step([UnitRequest(0, other.units[0].audio)])  # a unit of the other slot between
    assert left == cut - 4
    assert e.replay(1, 4) == 0 and e.replay_left(1) == 0
    resumed = [e.step([UnitRequest(1, u.audio, u.frames)])[0] for u in scenario.units[cut:]]
    assert [summary(o) for o in resumed] == [summary(o) for o in original[cut:]]


def test_records_hold_the_heard_audio_and_what_was_fed(tiny_weights):
    scenario = scenarios.camera()
    outcomes = run_alone(tiny_weights, scenario)
    for unit, outcome in zip(scenario.units, outcomes, strict=True):
        record = outcome.record
        assert np.array_equal(record.audio.astype(np.float32) / 32768, unit.audio)
        assert record.fed == tuple(outcome.fed) and record.codes == tuple(outcome.codes)
        assert record.images == tuple(unit.frames)
        assert outcome.audio.dtype == np.float32
        if outcome.listen:
            assert outcome.audio.size == 24000 and not outcome.audio.any()


def run_with_barge_in(weights, scenario, barge_at, *, upto=None):
    e = engine(weights, slots=1)
    e.open(0, e.prompt(scenario.prefix, scenario.suffix), seed=7)
    units = scenario.units[:upto]
    return [
        e.step([UnitRequest(0, u.audio, u.frames, force_listen=i == barge_at)])[0]
        for i, u in enumerate(units)
    ]


def test_a_barge_in_closes_the_open_turn_and_survives_a_restore(tiny_weights):
    scenario = scenarios.audio_long()
    plain = run_alone(tiny_weights, scenario)
    speaking = [i for i, o in enumerate(plain[:-4]) if not o.listen and not o.end_of_turn]
    assert speaking, "the tiny model never speaks mid-turn: no barge-in to test"
    barge_at = speaking[0] + 1
    special = tiny_weights.vocabulary.special
    interrupted = run_with_barge_in(tiny_weights, scenario, barge_at)
    cut = interrupted[barge_at]
    assert cut.listen and cut.fed == [special.turn_eos, special.listen]
    assert not cut.audio.any() and cut.codes == []
    # restored right after the barge-in, the session goes on as the original
    records = [o.record for o in interrupted[: barge_at + 1]]
    e = engine(tiny_weights, slots=1)
    e.begin_restore(0, e.prompt(scenario.prefix, scenario.suffix), seed=7, records=records)
    while e.replay(0, 8):
        pass
    resumed = [e.step([UnitRequest(0, u.audio)])[0] for u in scenario.units[barge_at + 1 :]]
    assert [summary(o) for o in resumed] == [summary(o) for o in interrupted[barge_at + 1 :]]


def test_a_long_session_slides_its_window_and_a_restore_slides_at_the_same_units(tiny_weights):
    scenario = scenarios.audio_long()
    window = ContextWindow(high=240, low=160)
    e = engine(tiny_weights, slots=1, window=window)
    prompt = e.prompt(scenario.prefix, scenario.suffix)
    e.open(0, prompt, seed=7)
    lengths, outcomes = [], []
    for unit in scenario.units:
        outcomes.append(e.step([UnitRequest(0, unit.audio)])[0])
        lengths.append(e.loop.memory.length(0))
    assert max(lengths) <= window.high
    assert any(b < a for a, b in itertools.pairwise(lengths)), "never slid"
    cut = 20
    r = engine(tiny_weights, slots=1, window=window)
    r.begin_restore(0, prompt, seed=7, records=[o.record for o in outcomes[:cut]])
    while r.replay(0, 7):
        pass
    assert r.loop.memory.length(0) == lengths[cut - 1]
    resumed = [r.step([UnitRequest(0, u.audio)])[0] for u in scenario.units[cut:]]
    assert [summary(o) for o in resumed] == [summary(o) for o in outcomes[cut:]]


def test_a_reference_voice_is_in_the_prompt_and_survives_a_restore(tiny_weights):
    scenario = scenarios.audio_short()
    rng = np.random.default_rng(5)
    voice = (0.2 * rng.standard_normal(int(2.3 * 16000))).astype(np.float32)
    e = engine(tiny_weights, slots=1)
    plain = e.prompt(scenario.prefix, scenario.suffix)
    voiced = e.prompt(scenario.prefix, scenario.suffix, voice)
    # 2.3 s: 230 mel frames, 115 positions after the convolutions, 23 embeddings
    assert voiced.voice is not None and voiced.voice.shape == (23, 128)
    assert voiced.ids == plain.ids
    e.open(0, voiced, seed=7)
    assert e.loop.memory.length(0) == len(plain.ids) + 23
    outcomes = [e.step([UnitRequest(0, u.audio)])[0] for u in scenario.units]
    r = engine(tiny_weights, slots=1)
    r.begin_restore(0, voiced, seed=7, records=[o.record for o in outcomes[:5]])
    while r.replay(0, 4):
        pass
    resumed = [r.step([UnitRequest(0, u.audio)])[0] for u in scenario.units[5:]]
    assert [summary(o) for o in resumed] == [summary(o) for o in outcomes[5:]]
