"""Tool calls of a frame-clocked model in the tick-batched stage (`ManualClock`): a frame with
calls is speech (it opens a response) and each call follows the frame's audio as a
"function_call" output, before the "listen" that ends the response; a frame's error is a
"nonfatal_error" output, speaking or not; `function_output` reaches the model of the
session's slot on the model thread, and the model answers it."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from harness.frame_models import (
    FRAME_SAMPLES,
    PARSE_ERROR_CODE,
    PARSE_ERROR_TOOL,
    RATE,
    ManualClock,
    ToolEchoFrameModel,
    tone,
)
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.contracts import (
    DuplexFence,
    DuplexSessionError,
    FrameModel,
    FrameOutput,
    FunctionCall,
    InputFedStagePort,
    StageOutput,
    StagePlan,
)

WEATHER = {"type": "function", "name": "get_weather"}
QUIET = np.zeros(FRAME_SAMPLES, np.float32)


class ScriptedModel(FrameModel):
    """Slot 0 says what `script` holds, one output a step (then quiet frames)."""

    input_sample_rate_hz = RATE
    output_sample_rate_hz = RATE
    frame_samples = FRAME_SAMPLES

    def __init__(self, script: list[FrameOutput]) -> None:
        self.slots = 2
        self.script = list(script)

    def open_slot(self, slot: int, options: Mapping[str, Any]) -> None:
        pass

    def interrupt_slot(self, slot: int) -> None:
        pass

    def close_slot(self, slot: int) -> None:
        pass

    def step(
        self,
        frames: np.ndarray,
        active: np.ndarray,
        images: Sequence[tuple[bytes, ...]] | None = None,
    ) -> list[FrameOutput | None]:
        quiet = FrameOutput(np.zeros(0, np.float32))  # no audio: a quiet frame sends nothing
        first = self.script.pop(0) if self.script else quiet
        return [first if active[0] else None] + [
            quiet if active[slot] else None for slot in range(1, self.slots)
        ]


class Rig:
    def __init__(self, model: FrameModel, **port_options: Any) -> None:
        self.clock = ManualClock()
        self.model = model
        self.port = TickBatchedStagePort(
            model, clock=self.clock, **{"listen_after_frames": 3, **port_options}
        )
        self.outputs: dict[str, list[StageOutput]] = {}

    async def open(self, session_id: str, options: dict[str, Any] | None = None) -> None:
        fence = DuplexFence(session_id, 0, 0)
        self.outputs[session_id] = []
        self.port.bind(session_id, functools.partial(self._sink, session_id))
        request_id = await self.port.ensure(fence, "stage0")
        await self.port.submit_initial(StagePlan(request_id, fence, "stage0", options or {}))

    def _sink(self, session_id: str, output: StageOutput) -> None:
        if output.kind != "ready":
            self.outputs[session_id].append(output)

    async def tick(self, count: int = 1) -> None:
        for _ in range(count):
            target = self.port.ticks + 1
            await self.clock.advance_to(await self.clock.next_sleeper())
            await asyncio.wait_for(self.port.wait_ticks(target), 5)

    def kinds(self, session_id: str) -> list[str]:
        return [output.kind for output in self.outputs[session_id]]


@pytest.fixture
async def tool_rig():
    made = Rig(ToolEchoFrameModel(2))
    yield made
    await made.port.shutdown()


async def test_a_call_opens_a_response_and_is_sent_before_the_listen_that_ends_it(tool_rig):
    rig = tool_rig
    await rig.open("a", {"tools": [WEATHER]})
    await rig.open("b")  # no tools: the same input makes no call
    for sid in ("a", "b"):
        rig.port.feed(sid, np.concatenate([tone(2), QUIET, QUIET, QUIET]))
    await rig.tick(5)
    assert rig.kinds("a") == ["function_call", "listen"]
    call = rig.outputs["a"][0].function_call
    assert call == FunctionCall("get_weather", json.dumps({"band": "low", "call": 1}))
    assert rig.kinds("b") == []


async def test_a_frames_audio_goes_first_then_its_calls_then_the_listen_it_ends_with():
    calls = (FunctionCall("a", "{}"), FunctionCall("b", '{"x": 1}', "call_b"))
    audio = np.full(FRAME_SAMPLES, 0.1, np.float32)
    rig = Rig(ScriptedModel([FrameOutput(audio, "hm", True, function_calls=calls)]))
    try:
        rig.port.max_response_frames = 1  # the frame ends its response
        await rig.open("a")
        await rig.tick()
        assert rig.kinds("a") == ["audio", "function_call", "function_call", "listen"]
        assert rig.outputs["a"][0].text == "hm"
        assert tuple(o.function_call for o in rig.outputs["a"][1:3]) == calls
    finally:
        await rig.port.shutdown()


async def test_a_quiet_frame_with_calls_is_speech():
    call = FunctionCall("a", "{}")
    rig = Rig(ScriptedModel([FrameOutput(np.zeros(0, np.float32), function_calls=(call,))]))
    try:
        await rig.open("a")
        await rig.tick(4)
        assert rig.kinds("a") == ["function_call", "listen"]
    finally:
        await rig.port.shutdown()


async def test_a_frames_error_is_a_nonfatal_error_output_speaking_or_not():
    audio = np.full(FRAME_SAMPLES, 0.1, np.float32)
    rig = Rig(
        ScriptedModel(
            [
                FrameOutput(QUIET, error=("quiet_error", "while listening")),
                FrameOutput(audio, ".", True, error=("speaking_error", "mid-response")),
            ]
        )
    )
    try:
        await rig.open("a")
        await rig.tick(5)
        # the frame's error follows its audio (a listening frame's goes alone)
        assert rig.kinds("a") == ["nonfatal_error", "audio", "nonfatal_error", "listen"]
        errors = [(o.error_code, o.message) for o in rig.outputs["a"][::2]]
        assert errors == [("quiet_error", "while listening"), ("speaking_error", "mid-response")]
    finally:
        await rig.port.shutdown()


async def test_the_tool_echo_models_unparsable_call_is_an_error_in_its_response(tool_rig):
    rig = tool_rig
    await rig.open("a", {"tools": [{"type": "function", "name": PARSE_ERROR_TOOL}]})
    rig.port.feed("a", np.concatenate([tone(1), QUIET, QUIET, QUIET]))
    await rig.tick(4)
    # a frame of its voice, with the error of the call it could not write; then quiet
    assert rig.kinds("a") == ["audio", "nonfatal_error", "listen"]
    assert rig.outputs["a"][1].error_code == PARSE_ERROR_CODE


async def test_function_output_reaches_the_slots_model_on_its_thread_and_it_answers(tool_rig):
    rig = tool_rig
    await rig.open("a")
    await rig.open("b", {"tools": [WEATHER]})
    rig.port.feed("b", np.concatenate([tone(1), QUIET, QUIET, QUIET]))
    await rig.tick(4)
    assert rig.kinds("b") == ["function_call", "listen"]
    threads: list[str] = []
    model = rig.model
    add = model.add_function_output

    def recording(*args: Any) -> None:
        threads.append(threading.current_thread().name)
        add(*args)

    model.add_function_output = recording  # type: ignore[method-assign]
    await rig.port.function_output("b", "call_1", "get_weather", "sunny")
    slot = rig.port.slot_of("b")
    assert model.outputs[slot] == [("call_1", "get_weather", "sunny")]
    assert model.outputs[rig.port.slot_of("a")] == []
    assert threads and threads[0].startswith("duplex-frame-model")
    await rig.tick(4 + 3)  # the answer's 4 frames, then quiet: a new response
    answer = rig.outputs["b"][2:]
    assert [o.kind for o in answer] == ["audio"] * 4 + ["listen"]
    assert "".join(o.text for o in answer) == "sunny"
    with pytest.raises(DuplexSessionError) as refused:
        await rig.port.function_output("nobody", "call_1", "get_weather", "x")
    assert refused.value.code == "unknown_session"


async def test_an_interrupt_drops_the_held_call_and_the_slot_calls_again(tool_rig):
    rig = tool_rig
    await rig.open("a", {"tools": [WEATHER]})
    rig.port.feed("a", tone(3, freq_hz=880))  # a high tone: the model holds its response
    await rig.tick(6)
    assert rig.kinds("a") == ["function_call"]  # no listen: it goes on until interrupted
    await rig.port.abort([rig.outputs["a"][0].request_id])
    fence = DuplexFence("a", 1, 0)
    await rig.port.ensure(fence, "stage0")
    rig.port.feed("a", np.concatenate([tone(1), QUIET, QUIET, QUIET]))
    await rig.tick(4)
    assert rig.kinds("a") == ["function_call", "function_call", "listen"]
    assert json.loads(rig.outputs["a"][1].function_call.arguments) == {"band": "low", "call": 2}
    assert rig.outputs["a"][1].fence == fence


async def test_a_stage_or_model_without_function_outputs_says_so():
    class Plain(InputFedStagePort):
        def bind(self, session_id, sink): ...
        async def ensure(self, fence, role):
            return ""

        async def submit_initial(self, plan): ...
        async def abort(self, request_ids): ...
        async def cleanup(self, session_id): ...
        def feed(self, session_id, samples): ...
        def held_sessions(self):
            return frozenset()

    with pytest.raises(NotImplementedError):
        await Plain().function_output("s", "call_1", "t", "out")
    with pytest.raises(NotImplementedError):
        ScriptedModel([]).add_function_output(0, "call_1", "t", "out")
