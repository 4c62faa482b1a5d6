"""Tool calls in a model-native session, through the SessionManager and its runner
(`ToolEchoFramePlugin` on a clock the test moves): the model's call opens a response and is
emitted as a function_call item when the response completes (GA's order, on both surfaces);
the client's function_call_output goes into history and to the model of the session's slot,
which then speaks again on its own; response.create stays refused; a cancel drops a held
call; a frame's error is an error event that fails nothing; the native surfaces drop the
call's events."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from harness.frame_models import (
    PARSE_ERROR_CODE,
    PARSE_ERROR_TOOL,
    RATE,
    EchoFramePlugin,
    ManualClock,
    ToolEchoFramePlugin,
    tone,
)
from harness.sessions import appends, types
from services.worker.control.manager import SessionManager
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.client.inline import InlineDuplexClient, InlineEventRouter
from shared.contracts import FrameClockedPlugin, SessionRuntimeConfig
from shared.protocol.duplex import CancelResponse, CreateResponse
from tests.protocol.ga_events import check_ga_event
from tests.worker.engine.test_tool_calls import CALL_EVENTS, output_item
from tests.worker.session_parts import LoudnessVad

QUIET = np.zeros(1920, np.float32)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TOOLS = {"tools": [WEATHER]}
OPENAI = {"duplex_surface": "openai", "turn_detection": None, **TOOLS}


class ToolRig:
    """tests/worker/engine/test_native_stream.py's rig, for any frame-clocked plugin."""

    def __init__(self, plugin: FrameClockedPlugin | None = None, max_sessions: int = 4) -> None:
        self.plugin = plugin or ToolEchoFramePlugin()
        self.model = self.plugin.frame_model(max_sessions)
        self.clock = ManualClock()
        self.port = TickBatchedStagePort.for_plugin(self.plugin, self.model, clock=self.clock)
        self.router = InlineEventRouter()
        runtime = SessionRuntimeConfig(max_sessions=max_sessions)
        self.manager = SessionManager(
            self.plugin, runtime, self.router, port=self.port, vad_backend=LoudnessVad
        )
        self.client = InlineDuplexClient(self.manager, self.router)

    async def open(self, session: dict):
        opened = await self.client.open(session)
        await self.settle(opened)  # its stream is open
        return opened

    async def say(self, opened, *frames: np.ndarray) -> None:
        for command in appends(np.concatenate(frames), RATE, chunk_ms=80):
            await opened.send(command)
        await self.settle(opened)

    async def tick(self, count: int = 1) -> None:
        for _ in range(count):
            target = self.port.ticks + 1
            await self.clock.advance_to(await self.clock.next_sleeper())
            await asyncio.wait_for(self.port.wait_ticks(target), 5)

    async def settle(self, opened) -> None:
        await self.manager.table.runner(opened.session_id).settle_input()

    def slot(self, opened) -> int:
        slot = self.port.slot_of(opened.session_id)
        assert slot is not None
        return slot


@pytest.fixture
async def rig():
    made = ToolRig()
    yield made
    await made.manager.shutdown()


async def called(rig: ToolRig, session) -> list:
    """A low tone: the model calls get_weather, goes quiet, and its response completes.
    Returns the events up to its response.done."""
    await rig.say(session, tone(2), QUIET, QUIET, QUIET, QUIET)
    await rig.tick(5)
    return await session.until("response.done")


def between(events: list, first: str, last: str) -> list[str]:
    kinds = types(events)
    return kinds[kinds.index(first) : kinds.index(last) + 1]


async def test_the_models_call_is_a_function_call_item_when_its_response_completes(rig):
    session = await rig.open(TOOLS)
    events = await called(rig, session)
    done = events[-1]
    assert done.response["status"] == "completed"
    assert between(events, "response.output_item.added", "response.done")[-8:] == [
        *CALL_EVENTS,
        "response.done",
    ]
    (call,) = [item for item in done.response["output"] if item["type"] == "function_call"]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"band": "low", "call": 1}
    assert call["call_id"].startswith("call_")
    arguments_done = next(
        e for e in events if e.wire_type == "response.function_call_arguments.done"
    )
    assert arguments_done.call_id == call["call_id"]
    # the message item opened with the response (duplex surface) closes empty, then the call
    assert done.response["output"][0]["type"] == "message"
    assert not [e for e in events if e.wire_type == "response.output_audio.delta"]
    runner = rig.manager.table.runner(session.session_id)
    assert runner.session.conversation.pending_call_ids() == [call["call_id"]]


async def test_the_clients_output_goes_to_the_model_which_then_speaks_again(rig):
    session = await rig.open(TOOLS)
    call = next(
        item
        for item in (await called(rig, session))[-1].response["output"]
        if item["type"] == "function_call"
    )
    await session.send(
        {"type": "conversation.item.create", "item": output_item(call["call_id"], "sunny")}
    )
    added = await session.until("conversation.item.done")
    assert added[-1].item["type"] == "function_call_output"
    await rig.settle(session)
    assert rig.model.outputs[rig.slot(session)] == [(call["call_id"], "get_weather", "sunny")]
    await session.send(CreateResponse(event_id="r1"))  # still the model's to decide
    error = (await session.until("error"))[-1]
    assert error.code == "unsupported_native_response_options"
    await rig.tick(4 + 3)  # the answer, then the model is quiet
    events = await session.until("response.done")
    assert events[-1].response["status"] == "completed"
    assert events[-1].response_id != call.get("response_id")
    audio = [e for e in events if e.wire_type == "response.output_audio.delta"]
    assert len(audio) == 4
    transcript = next(e for e in events if e.wire_type == "response.output_audio_transcript.done")
    assert transcript.transcript == "sunny"
    # answered once: a second output is refused as in any session
    await session.send(
        {"type": "conversation.item.create", "item": output_item(call["call_id"], "again")}
    )
    assert (await session.until("error"))[-1].code == "duplicate_function_output"
    assert len(rig.model.outputs[rig.slot(session)]) == 1


async def test_on_the_openai_surface_the_call_alone_is_the_responses_output_in_ga_shape(rig):
    session = await rig.open(OPENAI)
    events = await called(rig, session)
    for event in events:
        check_ga_event(event.to_dict())
    kinds = types(events)
    assert kinds[kinds.index("response.created") :] == [
        "response.created",
        *CALL_EVENTS,
        "response.done",
    ]
    done = events[-1]
    (call,) = done.response["output"]
    assert call["type"] == "function_call" and events[kinds.index(CALL_EVENTS[0])].output_index == 0
    await session.send(
        {"type": "conversation.item.create", "item": output_item(call["call_id"], "rain")}
    )
    await session.until("conversation.item.done")
    await rig.settle(session)
    await rig.tick(4 + 3)
    answer = await session.until("response.done")
    for event in answer:
        check_ga_event(event.to_dict())
    assert answer[-1].response["status"] == "completed"
    assert answer[-1].response["output"][0]["content"][0]["transcript"] == "rain"


async def test_a_cancel_while_a_call_is_held_drops_it(rig):
    session = await rig.open(TOOLS)
    await rig.say(session, tone(2, freq_hz=880))  # the model calls and holds its response
    await rig.tick(6)
    await session.until("response.created")
    await rig.settle(session)
    assert len(rig.model.calls[rig.slot(session)]) == 1  # the call is made, and held
    await session.send(CancelResponse(event_id="c1"))
    events = await session.until("response.done")
    assert events[-1].response["status"] == "cancelled"
    assert not [e for e in events if "function_call" in e.wire_type]
    assert not [i for i in events[-1].response["output"] if i["type"] == "function_call"]
    runner = rig.manager.table.runner(session.session_id)
    assert runner.session.conversation.pending_call_ids() == []
    await rig.settle(session)
    assert rig.model.interrupts[rig.slot(session)] == 1
    # the dropped call is unknown to the client; the next call is a new one, and arrives
    await session.send({"type": "conversation.item.create", "item": output_item("call_x")})
    assert (await session.until("error"))[-1].code == "unknown_function_call"
    events = await called(rig, session)
    (call,) = [i for i in events[-1].response["output"] if i["type"] == "function_call"]
    assert json.loads(call["arguments"]) == {"band": "low", "call": 2}


async def test_a_barge_in_while_a_call_is_held_drops_it_on_the_openai_surface_too(rig):
    session = await rig.open(OPENAI)
    await rig.say(session, tone(2, freq_hz=880))
    await rig.tick(6)
    await session.until("response.created")
    await session.send({"type": "output_audio_buffer.clear"})
    events = await session.until("response.done")
    assert events[-1].response["status"] == "cancelled"
    assert events[-1].response["output"] == []
    assert not [e for e in events if "function_call" in e.wire_type]


async def test_a_frames_error_is_an_error_event_and_the_response_goes_on(rig):
    session = await rig.open({"tools": [{"type": "function", "name": PARSE_ERROR_TOOL}]})
    events = await called(rig, session)
    errors = [e for e in events if e.wire_type == "error"]
    assert [e.code for e in errors] == [PARSE_ERROR_CODE]
    assert events[-1].response["status"] == "completed"  # the response was not failed
    kinds = types(events)
    assert kinds.index("response.output_audio.delta") < kinds.index("error")  # mid-response
    assert rig.manager.table.runner(session.session_id).session.active is None


async def test_a_model_that_takes_no_outputs_refuses_one_and_the_item_stays():
    rig = ToolRig(EchoFramePlugin())
    try:
        session = await rig.open({})
        call = {"type": "function_call", "call_id": "call_mine", "name": "t", "arguments": "{}"}
        await session.send({"type": "conversation.item.create", "item": call})
        await session.send({"type": "conversation.item.create", "item": output_item("call_mine")})
        events = await session.until("error")
        assert events[-1].code == "runtime_input_failed"
        history = rig.manager.table.runner(session.session_id).session.conversation.items
        assert [item["type"] for item in history] == ["function_call", "function_call_output"]
    finally:
        await rig.manager.shutdown()


@pytest.mark.parametrize("surface", ["moshi", "live"])
async def test_the_native_surfaces_drop_the_calls_events(rig, surface):
    session = await rig.open({"duplex_surface": surface, **TOOLS})
    await rig.say(session, tone(2), QUIET, QUIET, QUIET, QUIET)
    await rig.tick(6)
    await rig.settle(session)
    await rig.settle(session)  # the response's end, then its projection
    assert len(rig.model.calls[rig.slot(session)]) == 1
    seen = types(session.pending())
    assert not [t for t in seen if "function_call" in t or t.startswith("conversation.item")]
    assert not [t for t in seen if t == "error"]
