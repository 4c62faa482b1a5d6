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

Owner generations: every placement has one (1 at open; a restore's from its request), kept
in the session's record (`table.py`), where the publisher reads it to fence every publish.

A component of the `SessionManager` (`manager.moves`), beside it rather than part of it:
both work on the worker's `SessionTable` and build runners with the same `SessionBuilder`.
It implements `PublishHost` (`publish_host.py`), what the Redis publisher asks of the
sessions it publishes for (a checkpoint now; a session fenced out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.worker.control.builder import SessionBuilder
from services.worker.control.publish_host import FENCED_OUT, PublishHost
from services.worker.control.table import Phase, SessionRecord, SessionTable
from services.worker.engine.checkpoint import (
    CheckpointError,
    applied_mark,
    export_checkpoint,
    read_checkpoint,
    session_from_checkpoint,
)
from services.worker.engine.command_marks import CommandMarks, Mark
from services.worker.engine.lease import LeaseState
from services.worker.engine.response import INCOMPLETE
from services.worker.engine.runner import SessionRunner
from shared.contracts import (
    DuplexRuntimeConfigError,
    DuplexSessionError,
    ModelHistory,
    StageCleanupError,
)
from shared.protocol.duplex.errors import WORKER_LOST

log = logging.getLogger(__name__)

#: a restore's reason when the session was drained (moved with its final checkpoint)
DRAINED = "drain"
#: how long `hand_off` waits for the session's input work before it moves it all the same
#: (what was still in flight is then not in the checkpoint's `applied`: the new owner
#: reports it as `input_lost`)
SETTLE_TIMEOUT_S = 5.0


class SessionMoves(PublishHost):
    def __init__(self, table: SessionTable[SessionRunner], builder: SessionBuilder) -> None:
        self.table = table
        self.builder = builder

    def owned_sessions(self) -> dict[str, int]:
        """Session -> the owner generation this worker holds it at."""
        return {r.session_id: r.owner_generation for r in self.table.live()}

    def model_of(self, session_id: str) -> str:
        return self.builder.plugin.plugin_id

    # ------------------------------------------------------------ checkpoints

    def snapshot(self, session_id: str) -> bytes | None:
        """The session's checkpoint as it is now (None: not a live session of ours)."""
        record = self.table.get(session_id)
        if record is None or record.phase is not Phase.LIVE or record.runner is None:
            return None
        runner = record.runner
        return export_checkpoint(
            runner.session,
            applied=runner.marks.applied,
            model_state=self.builder.plugin.export_session_state(session_id),
        )

    def model_history(self, session_id: str) -> ModelHistory | None:
        record = self.table.get(session_id)
        return record.history if record is not None else None

    def is_idle(self, session_id: str) -> bool:
        """No active response, no commit or append in flight, no command waiting: a move
        now loses nothing and cuts nothing short. Committed turns waiting for a
        response.create do not count (the checkpoint carries them). A model-native session
        is always ready: what it is in the middle of moves with its model's state."""
        record = self.table.get(session_id)
        if record is None or record.phase is not Phase.LIVE or record.runner is None:
            return True
        runner = record.runner
        if runner.responses.native is not None:
            return True  # never idle, and never needs to be: the model's state moves with it
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
        record = self.table.get(session_id)
        if record is not None and record.runner is not None and record.runner.running:
            await record.runner.cancel_active(reason)

    def report_lost_commands(self, session_id: str, count: int) -> None:
        """Commands of a moving session that never arrived: the client appends again. Not
        in a model-native session: its stream is real time, and the audio lost while no
        worker held it is silence to the model (it cannot be spoken again); logged only."""
        runner = self.table.runner(session_id)
        if runner.responses.native is not None:
            log.info("session %s: %d command(s) lost in its move: silence", session_id, count)
            return
        runner.error(
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
        another worker. The stage is cleaned up; the slot is freed once it is. The record
        stays until its last events are published (and a drain's kept-back messages sent
        on), then goes.

        A model-native session moves as it is: its slot stops first (every frame the model
        stepped is then in its history and its output in the runner's mailbox, which the
        settle applies; a step in flight at that moment is dropped with its record, and
        the slot's state with it), its response in flight is not cancelled (the checkpoint
        carries it, and the model's next frames on the new worker go on with it), and its
        checkpoint carries no input audio (the model heard it: its history holds it)."""
        runner = self.table.runner(session_id)
        record = self.table.get(session_id)
        assert record is not None  # a runner is only found through its record
        native = runner.responses.native
        if native is not None:
            try:
                await self.builder.port.cleanup(session_id)
            except StageCleanupError:
                # the slot is out of the batch all the same (never stepped again, so its
                # history is whole); freeing it is retried by the session's cleanup below
                log.warning("session %s: its slot's close failed; moving it", session_id)
        try:
            async with asyncio.timeout(SETTLE_TIMEOUT_S):
                await runner.settle_input()
        except TimeoutError:
            log.warning(
                "session %s: input work still in flight after %.0f s; moving it without",
                session_id,
                SETTLE_TIMEOUT_S,
            )
        if record.phase is not Phase.LIVE:  # closed or dropped while it settled
            raise DuplexSessionError("session_closed", f"session {session_id} is closing")
        record.phase = Phase.LEAVING  # holds the slot until the stage is cleaned up
        session = runner.session
        try:
            if native is None:
                await runner.stop("shutdown")
            else:
                await runner.halt()
            data = export_checkpoint(
                session,
                applied=runner.marks.applied,
                model_state=self.builder.plugin.export_session_state(session_id),
                with_input=native is None,
            )
        finally:
            runner.silence()
            session.lease.mark_terminal()
            record.phase = Phase.GONE
            # the record stays until the caller has written this checkpoint after the
            # session's events (`RedisEventPublisher.write_checkpoint`)
            record.outbox.awaiting_final = True
        if native is not None:
            await runner.responses.close("shutdown")  # silenced: it goes on elsewhere
        await self.builder.cleanup(record)
        log.info("session %s handed off (%d checkpoint bytes)", session_id, len(data))
        return data

    async def restore(
        self,
        session_id: str,
        checkpoint: bytes,
        *,
        owner_generation: int,
        reason: str,
        model_history: bytes = b"",
        model_record_bytes: int | None = None,
        journaled_seq: int = 0,
    ) -> Mark:
        """Serve a session moved here from its checkpoint (and a model-native session's
        model history, which its slot is rebuilt from); returns the checkpoint's
        `applied` mark (the next command to apply is the one after it), which the
        session's command order starts from. Admission as `open` (raises
        `DuplexSessionError`: resource_exhausted, session_exists, a checkpoint that cannot
        be read or a plugin that refuses it). No session.created. A response in flight in
        the checkpoint cannot go on here (its stage ran on the lost worker): it ends with
        the failure chain, response.done `failed` with code `worker_lost` and its partial
        item out of history, then the error event. In a model-native session a drained
        response goes on (the model's state came with it), and one cut by a failover ends
        `incomplete` (reason `worker_lost`), its words kept: the model said them and
        remembers them; no error event, as for the input lost meanwhile."""
        builder, plugin = self.builder, self.builder.plugin
        record = self.table.reserve(session_id)  # the slot is held across the awaits below
        try:
            doc = read_checkpoint(checkpoint)
            if doc.get("session_id") != session_id:
                raise CheckpointError(f"it is session {doc.get('session_id')!r}'s")
            session = session_from_checkpoint(
                doc,
                capabilities=builder.capabilities,
                lease=LeaseState(builder.runtime.idle_ttl_s, clock=builder.clock),
                input_rate_hz=plugin.input_sample_rate_hz,
                output_rate_hz=plugin.output_sample_rate_hz,
            )
            applied = applied_mark(doc)
            pipeline = builder.pipeline(session.config, session.input.stream_ms)
            runner = builder.runner(session, pipeline, CommandMarks(applied))
            native = runner.responses.native
            if native is not None:
                native.restored_history(model_history, model_record_bytes)
                native.responding = session.active is not None and reason == DRAINED
            try:
                await plugin.import_session_state(
                    session_id, doc.get("model_state"), session.conversation.items
                )
            except DuplexRuntimeConfigError as exc:
                raise DuplexSessionError(exc.code, exc.message, param=exc.param) from None
            await builder.port.ensure(session.fence, plugin.stage_roles[0])
        except BaseException:
            self.table.abort(record)  # refused: the reservation goes, nothing else
            raise
        record.serve(
            runner,
            history=runner.history,
            owner_generation=owner_generation,
            unstamped=not session.config.stamps_seq,
            restored=True,
        )
        record.journaled_seq = journaled_seq  # its seq floor, as the journal had it
        record.order.restored(applied)
        try:
            if native is not None and native.responding:
                pass  # the model goes on with it (its stream re-opens under the same fence)
            elif native is not None and session.active is not None:
                runner.responses.finish(session.active, INCOMPLETE, WORKER_LOST)
            elif session.active is not None:
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
            # not served here after all (the caller refuses it): nothing of it is published
            # and the stage slot `ensure` took is given back (held, and retried by the
            # reaper, should the stage refuse)
            runner.silence()
            record.fenced = True
            record.outbox.discard()
            record.phase = Phase.GONE
            with contextlib.suppress(Exception):
                await runner.stop("dropped")
            await builder.cleanup(record)
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
        record = self.table.get(session_id)
        if record is None or record.phase not in (Phase.LIVE, Phase.LEAVING):
            return
        log.warning("session %s dropped: %s", session_id, why)
        record.fenced = True
        record.outbox.discard()
        runner = record.runner
        if runner is None:
            return
        runner.silence()
        runner.session.lease.mark_terminal()
        if record.phase is Phase.LIVE:
            record.phase = Phase.LEAVING
            self.builder.in_background(self._stop_dropped(record), f"session-drop:{session_id}")
        # else: a close or hand-off under way stops it and cleans up; silenced, it says nothing

    async def _stop_dropped(self, record: SessionRecord[SessionRunner]) -> None:
        assert record.runner is not None
        try:
            await record.runner.stop("dropped")
        finally:
            record.phase = Phase.GONE
            await self.builder.cleanup(record)
            self.table.settle(record)
