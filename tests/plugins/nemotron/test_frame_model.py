"""NemotronFrameModel: the frame contract on the tiny checkpoint (slots, prompt, records and
restore, barge-in, tool calls and results)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from plugins.nemotron.records import RecordLayout, decode
from plugins.nemotron.tools import render_system_prompt
from tests.plugins.nemotron.conftest import user_audio
from tests.plugins.nemotron.scripted import ANSWER, ScriptedNemotronFrameModel

FORECAST = {"temp": 21, "sky": "sunny", "wind": "a light breeze from the west", "rain": 0}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def options(tools: list | None = None) -> dict:
    tools = tools or []
    return {
        "system_prompt": render_system_prompt("you are a helpful voice assistant", tools),
        "tools": tools,
    }


def prime(model, slot: int) -> None:
    while model.replay_work(slot, model.replay_chunk_frames):
        pass


def run(model, audio: dict[int, np.ndarray]) -> dict[int, list]:
    """Step the slots of `audio` ({slot: [frames, 1280]}) together, frame by frame."""
    frames = len(next(iter(audio.values())))
    out: dict[int, list] = {slot: [] for slot in audio}
    for k in range(frames):
        batch = np.zeros((model.slots, model.frame_samples), dtype=np.float32)
        active = np.zeros(model.slots, dtype=bool)
        for slot, x in audio.items():
            batch[slot], active[slot] = x[k], True
        for slot, o in enumerate(model.step(batch, active)):
            if o is not None:
                out[slot].append(o)
    return out


def test_the_prompt_is_stepped_between_ticks_then_the_slot_hears_frames(make_model):
    model = make_model(2)
    model.open_slot(0, options())
    prompt = len(model.prompt_tokens(options()))
    assert prompt > 10
    assert model.prompt_frames_left(0) == model.replay_pending(0) == prompt
    with pytest.raises(ValueError, match="still stepping"):
        model.step(np.zeros((2, 1280), np.float32), np.array([True, False]))
    assert model.replay_work(0, 1) == 0  # the prompt in one forward, however few asked

    assert model.prompt_frames_left(0) == 0
    (outs,) = run(model, {0: user_audio(1, 3)}).values()
    assert [o.audio.shape for o in outs] == [(1764,)] * 3
    assert all(len(o.record) == model.state_record_bytes == 2702 for o in outs)


def test_a_restored_slot_steps_exactly_as_the_original(make_model):
    """Its history (records: audio, tokens, codes, tool-result tokens) replayed into another
    slot: from then on both give the same records and the same speech, frame for frame."""
    model = make_model(3)
    model.open_slot(0, options([WEATHER]))
    prime(model, 0)
    history = b"".join(o.record for o in run(model, {0: user_audio(2, 20)})[0])
    model.add_function_output(0, "call_1", "get_weather", json.dumps({"temp": 21}))
    history += b"".join(o.record for o in run(model, {0: user_audio(3, 6)})[0])
    records = decode(RecordLayout(31, model.max_injected_tokens), history)
    injected = [t for r in records for t in r.injected]
    assert injected and max(len(r.injected) for r in records) <= model.max_injected_tokens

    model.restore_slot(2, options([WEATHER]), history)
    assert model.replay_pending(2) > len(records)
    prime(model, 2)
    audio = user_audio(4, 12)
    outs = run(model, {0: audio, 2: audio})
    for a, b in zip(outs[0], outs[2], strict=True):
        assert a.record == b.record
        assert np.allclose(a.audio, b.audio, atol=1e-5)
        assert a.text == b.text and a.speaking == b.speaking


def test_a_barge_in_ends_the_models_turn_and_keeps_its_memory(make_model):
    model = make_model(1)
    model.open_slot(0, {})
    outs = run(model, {0: user_audio(5, 40)})[0]
    assert any(o.speaking for o in outs)
    # the tiny model's text: open a turn by feeding a BOS, then interrupt
    conversation = model._slot(0)
    conversation.in_turn = True
    model.interrupt_slot(0)
    (after,) = run(model, {0: user_audio(6, 1)})[0]
    record = decode(RecordLayout(31, model.max_injected_tokens), after.record)[0]
    assert record.text == model.engine.eos
    assert not model._slot(0).in_turn
    assert model.engine.state[0].position == 41  # the slot went on: nothing was reset


def test_scripted_tool_call_becomes_a_function_call_and_the_result_reaches_the_model(tiny_dir):
    """The function channel's tokens (scripted, as tests/plugins/nemotron/scripted.py does) parse to
    one call, withheld from the words; the result is fed as tokens before the next frames,
    and the model then says the scripted answer."""
    model = ScriptedNemotronFrameModel.load(str(tiny_dir), 1, "cpu", 1)
    model.open_slot(0, options([WEATHER]))
    prime(model, 0)
    loud = np.full((1, 1280), 0.5, dtype=np.float32)
    quiet = np.zeros((60, 1280), dtype=np.float32)
    outs = run(model, {0: np.concatenate([loud, quiet])})[0]
    calls = [c for o in outs for c in o.function_calls]
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert not any("TOOLCALL" in o.text for o in outs)
    assert all(o.error is None for o in outs)
    model.add_function_output(0, "call_1", "get_weather", json.dumps(FORECAST))
    pending = len(model._slot(0).injections)
    assert pending > model.max_injected_tokens  # spread over several frames
    outs = run(model, {0: np.zeros((40, 1280), np.float32)})[0]
    said = "".join(o.text for o in outs)
    assert ANSWER.strip() in said


def test_a_call_that_does_not_parse_is_a_nonfatal_error(make_model):
    model = make_model(1)
    model.open_slot(0, options([WEATHER]))
    prime(model, 0)
    conversation = model._slot(0)
    bad = model.tokenizer.text_to_ids('<TOOLCALL>[{"name": "nope", "arguments": {}}]</TOOLCALL>')
    errors = []
    for token in bad:
        _text, calls, error, _ = model._account(conversation, model.engine.pad, token)
        assert not calls
        errors.append(error)
    assert [e for e in errors if e] == [errors[-1]]
    assert errors[-1][0] == "nemotron_function_call_parse_error"


def test_slots_are_checked(make_model):
    model = make_model(2)
    with pytest.raises(ValueError, match="not open"):
        model.interrupt_slot(1)
    with pytest.raises(ValueError, match="out of range"):
        model.open_slot(2, {})
    model.open_slot(1, {})
    model.close_slot(1)
    with pytest.raises(ValueError, match="not open"):
        model.replay_work(1, 1)
    model.open_slot(1, {})
    for frames in (0, model.replay_chunk_frames + 1):
        with pytest.raises(ValueError, match="frames a call"):
            model.replay_work(1, frames)


def test_a_barge_in_mid_call_is_in_the_history_and_a_restore_drops_the_call_too(tiny_dir):
    """A barge-in while the function channel writes a call drops the half-written block;
    the frame's record says so, so a slot restored from the history is in the same state
    (not inside a block that would swallow its next words)."""
    model = ScriptedNemotronFrameModel.load(str(tiny_dir), 3, "cpu", 1)
    model.open_slot(0, options([WEATHER]))
    prime(model, 0)
    loud = np.full((1, 1280), 0.5, dtype=np.float32)
    outs = run(model, {0: np.concatenate([loud, np.zeros((5, 1280), np.float32)])})[0]
    assert model._slot(0).parser.in_call  # the call is half written
    model.interrupt_slot(0)
    outs += run(model, {0: np.zeros((3, 1280), np.float32)})[0]
    assert not model._slot(0).parser.in_call
    history = b"".join(o.record for o in outs)
    assert [r.interrupted for r in decode(RecordLayout(31, 16), history)].count(True) == 1

    model.restore_slot(2, options([WEATHER]), history)
    prime(model, 2)
    assert not model._slot(2).parser.in_call
    assert model._slot(2).in_turn == model._slot(0).in_turn
