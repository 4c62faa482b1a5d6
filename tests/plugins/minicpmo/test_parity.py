"""Parity with OpenBMB's reference duplex loop, token for token.

The golden lists (tests/plugins/minicpmo/golden/*.json) were produced by the reference
`MiniCPMODuplex` (OpenBMB's pytorch demo, greedy, its speech sampler taking the argmax) on
the tiny checkpoint our builder makes from the recorded seed; golden/README.md says how.
Here the same checkpoint is rebuilt, and our engine (greedy words and codes) is run on the
same inputs: alone, and two sessions in one batch with the second joining later. Unit for
unit it must make the same listen/speak decision, feed the same tokens (chosen, replaced,
forced), say the same words and give the same speech codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plugins.minicpmo.engine import EngineSettings, UnitEngine, UnitRequest
from plugins.minicpmo.records import TokenOrigin
from plugins.minicpmo.text_sampling import TextSampling
from plugins.minicpmo.vocoder import ToneDecoder
from tests.plugins.minicpmo.golden import scenarios

GOLDEN = Path(__file__).parent / "golden"
KINDS = {
    "sampled": TokenOrigin.CHOSEN,
    "listen_replaced": TokenOrigin.REPLACED,
    "forced_chunk_eos": TokenOrigin.FORCED,
}


def golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


def expected(name: str) -> list[tuple]:
    """(listen, fed ids, their origins, words, codes) per unit, as the reference made them."""
    units = []
    for unit in golden(name)["units"]:
        ids, kinds = unit["ids"], unit["kinds"]
        assert kinds[-1] == "unit_end"
        units.append(
            (
                unit["listen"],
                tuple(ids[:-1]),
                tuple(KINDS[k] for k in kinds[:-1]),
                unit["text"],
                tuple(unit["codes"]) if unit["codes"] is not None else (),
            )
        )
    return units


def observed(outcome) -> tuple:
    return (
        outcome.listen,
        tuple(outcome.fed),
        tuple(outcome.origins),
        outcome.text,
        tuple(outcome.codes),
    )


@pytest.fixture(scope="module")
def parity_weights(tmp_path_factory):
    """The checkpoint of the golden lists' seed (all three were made from one)."""
    from plugins.minicpmo.builder import build_tiny_checkpoint
    from plugins.minicpmo.model import MiniCPMOWeights

    seeds = {golden(name)["builder_seed"] for name in scenarios.SCENARIOS}
    assert len(seeds) == 1
    directory = tmp_path_factory.mktemp("minicpmo-parity") / "tiny"
    return MiniCPMOWeights.load(build_tiny_checkpoint(directory, seed=seeds.pop()))


def engine(weights, slots: int) -> UnitEngine:
    return UnitEngine(
        weights,
        ToneDecoder(),
        EngineSettings(slots=slots, sampling=TextSampling(greedy=True), speech_greedy=True),
    )


def test_the_golden_inputs_are_the_scenarios_inputs():
    """The lists were made on these exact inputs (a drifting JPEG encoder or audio
    generator shows here, not as a model mismatch)."""
    for name, make in scenarios.SCENARIOS.items():
        units = make().units
        recorded = golden(name)["units"]
        assert len(recorded) == len(units)
        assert [scenarios.unit_digest(u) for u in units] == [u["input_sha256"] for u in recorded]


def top_gap(values: torch.Tensor) -> float:
    finite = values[torch.isfinite(values)]
    top = torch.topk(finite, 2).values
    return float(top[0] - top[1])


def record_margins(e: UnitEngine) -> list[tuple[float, float | None]]:
    """Each decision's margins as the reference's driver measured them: the first look's
    `<|chunk_eos|>` logit against the best other, and the second look's top-2 gap (None
    when the first look ended the unit)."""
    decider, seen = e.loop.decider, []
    choose = decider.choose

    def watched(logits, history, generator):
        others = torch.cat([logits[: decider.chunk_eos], logits[decider.chunk_eos + 1 :]])
        eos_gap = float(logits[decider.chunk_eos] - others.max())
        gap = None if eos_gap > 0 else top_gap(decider.penalised(logits, history))
        seen.append((eos_gap, gap))
        return choose(logits, history, generator)

    decider.choose = watched
    return seen


@pytest.mark.parametrize("name", sorted(scenarios.SCENARIOS))
def test_one_session_alone_says_what_the_reference_says(parity_weights, name):
    scenario = scenarios.SCENARIOS[name]()
    e = engine(parity_weights, 1)
    margins = record_margins(e)
    prompt = e.prompt(scenario.prefix, scenario.suffix, scenario.ref_audio)
    recorded = golden(name)["prompt"]
    assert prompt.ids == recorded["prefix_ids"] + recorded["suffix_ids"]
    e.open(0, prompt, seed=0)
    if scenario.ref_audio is not None:
        # the reference voice: as many embeddings, in as many prompt positions, as the
        # reference fed (its norms: the mel's floor, the chunk mask and the padding)
        voice = recorded["ref_audio"]
        assert prompt.voice is not None
        assert e.loop.memory.length(0) == recorded["positions"]
        norms = prompt.voice.norm(dim=-1).tolist()
        assert norms == pytest.approx(voice["embedding_norms"], rel=1e-4, abs=1e-4)
    ours = [observed(e.step([UnitRequest(0, u.audio, u.frames)])[0]) for u in scenario.units]
    for index, (mine, theirs) in enumerate(zip(ours, expected(name), strict=True)):
        assert mine == theirs, f"{name} unit {index}: ours {mine} != reference {theirs}"
    # the numbers behind the decisions too: a camera frame or the prompt moves the margins
    # without changing a choice of the tiny model, so equal ids alone would not show that
    # they reach the model as the reference feeds them (the lists keep 5 digits)
    reference = [(d[0], d[1]) for unit in golden(name)["units"] for d in unit["decisions"]]
    assert len(margins) == len(reference)
    for index, ((eos, gap), (ref_eos, ref_gap)) in enumerate(zip(margins, reference, strict=True)):
        assert eos == pytest.approx(ref_eos, rel=1e-3, abs=1e-3), f"decision {index}"
        assert (gap is None) == (ref_gap is None), f"decision {index}"
        if gap is not None:
            assert gap == pytest.approx(ref_gap, rel=1e-3, abs=1e-3), f"decision {index}"


def test_two_sessions_in_one_batch_the_second_joining_later(parity_weights):
    """The camera session from its first unit, the short audio one joining at its fourth:
    each says what the reference said for it alone."""
    camera, short = scenarios.camera(), scenarios.audio_short()
    join = 3
    e = engine(parity_weights, 2)
    e.open(1, e.prompt(camera.prefix, camera.suffix), seed=0)
    seen: dict[str, list[tuple]] = {"camera": [], "audio_short": []}
    total = max(len(camera.units), join + len(short.units))
    for index in range(total):
        requests = []
        if index < len(camera.units):
            requests.append(UnitRequest(1, camera.units[index].audio, camera.units[index].frames))
        if index == join:
            e.open(0, e.prompt(short.prefix, short.suffix), seed=0)
        if join <= index < join + len(short.units):
            requests.append(UnitRequest(0, short.units[index - join].audio))
        for outcome in e.step(requests):
            seen["camera" if outcome.slot == 1 else "audio_short"].append(observed(outcome))
    assert seen["camera"] == expected("camera")
    assert seen["audio_short"] == expected("audio_short")
