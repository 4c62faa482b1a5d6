"""`SessionMoves`: the half of the `SessionManager` that lets a session outlive its worker.

- `snapshot(sid)`: the session's checkpoint now (the publisher calls it, synchronously,
  when it takes a batch holding a durable event of the session);
- `hand_off(sid)`: a drain's move: the runner stops once its input work is applied, the
  final checkpoint carries the uncommitted turn's audio, the session is forgotten here
  without `session.closed`;
- `restore(sid, checkpoint, ...)`: the other end of a move (drain or failover): admission
  as `open`, the session rebuilt from its checkpoint, no `session.created`; a response in
  flight in the checkpoint (a failover) ends with the failure chain, code `worker_lost`;
- `drop(sid, why)`: fenced out (another worker owns the session now): no event at all;
- `owned_sessions`, `is_idle`, `cancel_active`, `report_lost_commands`, `model_of`.

Owner generations: every placement has one (1 at open; a restore's from its request).
The manager tells the event sink (`set_owner`) so that every publish is fenced on it.

A mixin: it reads the manager's admission state (`_runners`, `_closing`, `_opening`) and
builds runners with its `_new_runner`; it imports nothing of `manager.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from services.worker.session.checkpoint import (
    CheckpointError,
    applied_mark,
    export_checkpoint,
    read_checkpoint,
    session_from_checkpoint,
)
from services.worker.session.command_marks import CommandMarks, Mark
from services.worker.session.engine_session import EngineSession
from services.worker.session.lease import LeaseState
from services.worker.session.runner import SessionRunner
from shared.contracts import (
    DuplexCapabilities,
    DuplexModelPlugin,
    DuplexRuntimeConfigError,
    DuplexSessionError,
    SessionEventSink,
    SessionRuntimeConfig,
    StagePort,
)

log = logging.getLogger(__name__)

WORKER_LOST = "worker_lost"
FENCED_OUT = "fenced out: another worker owns the session now"
#: how long `hand_off` waits for the session's input work before it moves it all the same
#: (what was still in flight is then not in the checkpoint's `applied`: the new owner
#: reports it as `input_lost`)
SETTLE_TIMEOUT_S = 5.0


class SessionMoves:
    plugin: DuplexModelPlugin
    runtime: SessionRuntimeConfig
    sink: SessionEventSink
    port: StagePort
    capabilities: DuplexCapabilities
    clock: Callable[[], float]
    _runners: dict[str, SessionRunner]
    _closing: dict[str, EngineSession]
    _opening: int
    _owners: dict[str, int]
    _background: set[asyncio.Task[None]]

    # and, from the manager: runner(sid), _admit(sid), _pipeline(config, stream_ms),
    # _new_runner(session, pipeline, marks), _cleanup(sid), _closed_later(task)

    # ------------------------------------------------------------ owners

    def _bind_sink(self) -> None:
        """A sink that fences and checkpoints (the Redis publisher) learns whom to ask."""
        attach = getattr(self.sink, "attach_host", None)
        if callable(attach):
            attach(snapshot=self.snapshot, on_fenced=self.drop)

    def _set_owner(self, session_id: str, generation: int) -> None:
        self._owners[session_id] = generation
        set_owner = getattr(self.sink, "set_owner", None)
        if callable(set_owner):
            # an openai-surface session's JSON goes without server_event_seq (GA has none)
            runner = self._runners.get(session_id)
            openai = runner is not None and runner.session.config.openai_surface
            set_owner(session_id, generation, stamp_seq=not openai)

    def owned_sessions(self) -> dict[str, int]:
        """Session -> the owner generation this worker holds it at."""
        return {sid: gen for sid, gen in self._owners.items() if sid in self._runners}

    def model_of(self, session_id: str) -> str:
        return self.plugin.plugin_id

    # ------------------------------------------------------------ checkpoints

    def snapshot(self, session_id: str) -> bytes | None:
        """The session's checkpoint as it is now (None: not a live session of ours)."""
        runner = self._runners.get(session_id)
        if runner is None:
            return None
        return export_checkpoint(
            runner.session,
            applied=runner.marks.applied,
            model_state=self.plugin.export_session_state(session_id),
        )

    def is_idle(self, session_id: str) -> bool:
        """No active response, no commit or append in flight, no command waiting: a move
        now loses nothing and cuts nothing short. Committed turns waiting for a
        response.create do not count (the checkpoint carries them)."""
        runner = self._runners.get(session_id)
        if runner is None:
            return True
        session = runner.session
        return (
            session.active is None
            and session.pending_commits == 0
            and session.pending_input_bytes == 0
            and runner.input_idle
        )

    async def cancel_active(self, session_id: str, reason: str = "shutdown") -> None:
        """The session's active response, if any, ends with the cancelled chain (`reason`),
        as a response.cancel would end it; returns once it has."""
        runner = self._runners.get(session_id)
        if runner is not None and runner.running:
            await runner.cancel_active(reason)

    def report_lost_commands(self, session_id: str, count: int) -> None:
        """Commands of a moving session that never arrived: the client appends again."""
        self.runner(session_id).error(
            "input_lost",
            f"{count} command(s) sent while the session moved to another worker were lost; "
            "append the current turn's audio again",
            lost_commands=count,
        )

    # ------------------------------------------------------------ moves

    async def hand_off(self, session_id: str) -> bytes:
        """Stop serving the session here and return its final checkpoint (with the
        uncommitted turn's audio). The runner stops after every command submitted so
        far and the input work it queued are applied; a response still active ends with
        the cancelled chain (`shutdown`). No `session.closed`: the session goes on on
        another worker. The stage is cleaned up; the slot is freed once it is."""
        runner = self.runner(session_id)
        try:
            async with asyncio.timeout(SETTLE_TIMEOUT_S):
                await runner.settle_input()
        except TimeoutError:
            log.warning(
                "session %s: input work still in flight after %.0f s; moving it without",
                session_id,
                SETTLE_TIMEOUT_S,
            )
        self._runners.pop(session_id, None)
        session = runner.session
        self._closing[session_id] = session  # holds the slot until the stage is cleaned up
        try:
            await runner.stop("shutdown")
            data = export_checkpoint(
                session,
                applied=runner.marks.applied,
                model_state=self.plugin.export_session_state(session_id),
                with_input=True,
            )
        finally:
            runner.silence()
            session.state = "closed"
            session.lease.mark_terminal()
            self._owners.pop(session_id, None)
        if await self._cleanup(session_id):
            self._closing.pop(session_id, None)
        log.info("session %s handed off (%d checkpoint bytes)", session_id, len(data))
        return data

    async def restore(
        self, session_id: str, checkpoint: bytes, *, owner_generation: int, reason: str
    ) -> Mark:
        """Serve a session moved here from its checkpoint; returns the checkpoint's
        `applied` mark (the next command to apply is the one after it). Admission as
        `open` (raises `DuplexSessionError`: resource_exhausted, session_exists, a
        checkpoint that cannot be read or a plugin that refuses it). No session.created.
        A response in flight in the checkpoint cannot go on here (its stage ran on the
        lost worker): it ends with the failure chain, response.done `failed` with code
        `worker_lost` and its partial item out of history, then the error event."""
        self._admit(session_id)
        self._opening += 1  # the slot is held across the awaits below
        try:
            doc = read_checkpoint(checkpoint)
            if doc.get("session_id") != session_id:
                raise CheckpointError(f"it is session {doc.get('session_id')!r}'s")
            session = session_from_checkpoint(
                doc,
                capabilities=self.capabilities,
                lease=LeaseState(self.runtime.idle_ttl_s, clock=self.clock),
                input_rate_hz=self.plugin.input_sample_rate_hz,
                output_rate_hz=self.plugin.output_sample_rate_hz,
            )
            applied = applied_mark(doc)
            pipeline = self._pipeline(session.config, session.input.stream_ms)
            runner = self._new_runner(session, pipeline, CommandMarks(applied))
            try:
                await self.plugin.import_session_state(
                    session_id, doc.get("model_state"), session.conversation.items
                )
            except DuplexRuntimeConfigError as exc:
                raise DuplexSessionError(exc.code, exc.message, param=exc.param) from None
            await self.port.ensure(session.fence, self.plugin.stage_roles[0])
            self._runners[session_id] = runner
        finally:
            self._opening -= 1
        self._set_owner(session_id, owner_generation)
        try:
            if session.active is not None:
                # before the runner's task starts, this coroutine is the session's one writer
                runner.responses.fail(
                    session.active,
                    WORKER_LOST,
                    f"the worker serving this response was lost ({reason}); "
                    + (
                        "the session goes on here: the model speaks again when it will"
                        if runner.responses.native is not None
                        else "the session goes on here: create the response again"
                    ),
                )
            runner.start()
        except BaseException:
            # not served here after all (the caller refuses it): no slot or owner is kept
            self._runners.pop(session_id, None)
            self._owners.pop(session_id, None)
            with contextlib.suppress(Exception):  # the stage slot `ensure` took, given back
                await self.port.cleanup(session_id)
            raise
        log.info(
            "session %s restored (%s, owner generation %d, applied %s)",
            session_id,
            reason,
            owner_generation,
            applied,
        )
        return applied

    def drop(self, session_id: str, why: str = FENCED_OUT) -> None:
        """Another worker owns the session now: forget it here without a single event
        (whatever it still emits is discarded), clean its stage up, free its slot."""
        runner = self._runners.pop(session_id, None)
        if runner is None:
            return
        log.warning("session %s dropped: %s", session_id, why)
        runner.silence()
        self._owners.pop(session_id, None)
        forget = getattr(self.sink, "forget_session", None)
        if callable(forget):
            forget(session_id)
        session = runner.session
        session.state = "closed"
        session.lease.mark_terminal()
        self._closing[session_id] = session
        task = asyncio.create_task(self._stop_dropped(runner), name=f"session-drop:{session_id}")
        self._background.add(task)
        task.add_done_callback(self._closed_later)

    async def _stop_dropped(self, runner: SessionRunner) -> None:
        session_id = runner.session.session_id
        await runner.stop("dropped")
        if await self._cleanup(session_id):
            self._closing.pop(session_id, None)
