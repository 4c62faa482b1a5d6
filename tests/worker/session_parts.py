"""One session's parts without a manager or a runner: its state, input pipeline, the two
controllers and the dispatch context, over a stage port that only records. The test plays
the runner: it drains the mailbox the input task delivers to (`next_ready`) and applies
each item (`apply`), so every order the tests assert is one the controllers produced."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from harness.sessions import appends, sine
from plugins.echo import EchoPlugin
from services.worker.engine.command_marks import CommandTicket
from services.worker.engine.engine_session import EngineSession
from services.worker.engine.handlers import SessionContext, dispatch, on_stage_output
from services.worker.engine.idle_timeout import IdleDue
from services.worker.engine.input_controller import InputController
from services.worker.engine.input_pipeline import InputPipeline
from services.worker.engine.input_queue import AppendReady, CommitReady, InOrder
from services.worker.engine.lease import LeaseState
from services.worker.engine.ledgers import InputLedger
from services.worker.engine.response_controller import ResponseController
from services.worker.engine.transcription import PartialTranscript
from services.worker.engine.vad import VadBackend, VadStream
from shared.contracts import (
    CommittedTurn,
    DuplexFence,
    DuplexSessionConfig,
    ResponseCreateOptions,
    StageOutput,
    StagePlan,
    StagePort,
    stage_request_id,
)
from shared.protocol.duplex import AppendAudio, Commit, DuplexEvent, float_to_pcm16

SESSION_ID = "duplex-parts"
RATE = 16_000  # the echo model's input rate: the resampler passes audio through


class RecordingPort(StagePort):
    """A stage port that starts nothing: the test plays the stage with `output`."""

    def __init__(self) -> None:
        self.sinks: dict[str, Any] = {}
        self.plans: list[StagePlan] = []
        self.aborted: list[str] = []

    def bind(self, session_id, sink) -> None:
        self.sinks[session_id] = sink

    async def ensure(self, fence: DuplexFence, role: str) -> str:
        return stage_request_id(fence, role)

    async def submit_initial(self, plan: StagePlan) -> None:
        self.plans.append(plan)

    async def abort(self, request_ids) -> None:
        self.aborted += list(request_ids)

    async def cleanup(self, session_id: str) -> None:
        self.sinks.pop(session_id, None)

    def held_sessions(self) -> frozenset[str]:
        return frozenset(self.sinks)


class LoudnessVad(VadBackend):
    """A VAD that hears speech in any frame louder than 0.05 RMS."""

    def new_stream(self) -> VadStream:
        return _LoudnessStream()


class _LoudnessStream(VadStream):
    def probability(self, frame: np.ndarray) -> float:
        return 1.0 if float(np.sqrt(np.mean(frame**2))) > 0.05 else 0.0


@dataclasses.dataclass
class Parts:
    session: EngineSession
    port: RecordingPort
    pipeline: InputPipeline
    responses: ResponseController
    input: InputController
    ctx: SessionContext
    events: list[DuplexEvent]
    mailbox: asyncio.Queue[Any]
    executor: ThreadPoolExecutor

    def take_events(self) -> list[DuplexEvent]:
        taken, self.events[:] = list(self.events), []
        return taken

    def append(self, samples: np.ndarray, reserved: int = 100) -> AppendAudio:
        """Dispatch one pcm16 append of `samples`, reserving as the manager does."""
        command = AppendAudio(audio=float_to_pcm16(samples), format="pcm16", sample_rate_hz=RATE)
        self.session.pending_input_bytes += reserved
        self.input.schedule_append(command, CommandTicket(reserved))
        return command

    def speech(self, seconds: float) -> list[AppendAudio]:
        """20 ms appends of a loud sine, dispatched."""
        commands = appends(sine(RATE, seconds), RATE)
        for command in commands:
            self.session.pending_input_bytes += 100
            self.input.schedule_append(command, CommandTicket(100))
        return commands

    def commit(self, **fields) -> Commit:
        """Dispatch a commit, reserving a pending commit as the manager does."""
        command = Commit(**fields)
        self.session.pending_commits += 1
        self.input.schedule_commit(command, CommandTicket(1))
        return command

    async def next_ready(self) -> Any:
        return await self.mailbox.get()

    async def apply(self, item: Any) -> None:
        """What the runner's task does with a mailbox item."""
        match item:  # as `SessionRunner._handle` routes them (no marks here)
            case PartialTranscript():
                self.input.on_partial(item)
            case IdleDue():
                await self.input.on_idle_due(item)
            case StageOutput():
                await on_stage_output(self.ctx, item)
            case AppendReady():
                await self.input.on_append_ready(item)
            case CommitReady():
                await self.input.on_commit_ready(item)
            case InOrder():
                await dispatch(self.ctx, item.command, in_order=True)
            case _:
                raise AssertionError(f"unexpected mailbox item {item!r}")

    async def apply_next(self, count: int) -> list[Any]:
        """Apply the next `count` items as they arrive (an applied item may queue more
        work: a VAD turn end queues its commit)."""
        items = []
        for _ in range(count):
            items.append(await self.next_ready())
            await self.apply(items[-1])
        return items

    async def start_response(self, seconds: float = 0.5) -> Any:
        """An active response to a turn of `seconds` (nothing of it spoken yet)."""
        turn = CommittedTurn(1, "item_user", sine(RATE, seconds), RATE)
        await self.responses.start_response(turn, ResponseCreateOptions(), None)
        return self.session.active

    def output(self, kind: str, seconds: float = 0.1, text: str = "", **fields) -> StageOutput:
        """A stage output of the active response (or of `fence`/`request_id` in fields)."""
        active = self.session.active
        fence = fields.pop("fence", active.fence if active else None)
        request_id = fields.pop("request_id", active.request_id if active else "")
        audio = sine(24_000, seconds) if kind == "audio" else None
        rate = 24_000 if kind == "audio" else None
        return StageOutput(
            request_id, fence, kind, audio=audio, sample_rate_hz=rate, text=text, **fields
        )


async def make_parts(
    session: dict[str, Any] | None = None,
    *,
    vad: bool = False,
    plugin: Any = None,
    state: EngineSession | None = None,
) -> Parts:
    """`state`: the session's state as it is (a restored checkpoint's), else a new one."""
    plugin = plugin or EchoPlugin()
    config = DuplexSessionConfig.from_realtime(session or {"extra_body": {"pace": 0}})
    state = state or EngineSession(
        session_id=SESSION_ID,
        config=config,
        runtime_config=await plugin.prepare_runtime_config(config),
        capabilities=plugin.capabilities(4),
        lease=LeaseState(None),
        input=InputLedger(plugin.input_sample_rate_hz),
    )
    config = state.config
    pipeline = InputPipeline(plugin.input_sample_rate_hz, LoudnessVad if vad else None)
    pipeline.configure_vad(config.turn_detection, 0)
    port = RecordingPort()
    events: list[DuplexEvent] = []
    mailbox: asyncio.Queue[Any] = asyncio.Queue()
    executor = ThreadPoolExecutor(1, thread_name_prefix="parts")

    def emit(event: DuplexEvent) -> None:  # the runner's emit: recorded, then observed
        events.append(event)
        controller.observe(event)

    responses = ResponseController(state, plugin, port, emit)
    controller = InputController(
        state, plugin, pipeline, executor, responses, emit, mailbox.put_nowait
    )
    port.bind(SESSION_ID, mailbox.put_nowait)
    ctx = SessionContext(state, plugin, controller, responses, emit)
    controller.start()
    return Parts(state, port, pipeline, responses, controller, ctx, events, mailbox, executor)


async def close_parts(parts: Parts) -> None:
    await parts.input.stop()
    parts.executor.shutdown(wait=True)
