"""One record per session (`services/worker/control/table.py`): every path a session leaves
a worker by removes all of it, and only once nothing of it is left to do (its last events
published, its stage slot cleaned up, a drain's kept-back messages sent on). The stage
keeps nothing of it either (`StagePort.held_sessions`): the echo plugin's task stage, and
the tick stage of a frame-clocked model (its slot state) on every path at the end."""

import asyncio

import orjson
import pytest

from harness.frame_models import EchoFramePlugin, ManualClock
from harness.sessions import appends, sine
from plugins.echo import EchoPlugin
from services.worker.control.manager import SessionManager
from services.worker.control.table import Phase, SessionTable
from services.worker.publisher import RedisEventPublisher
from services.worker.stages.tick_batched import TickBatchedStagePort
from shared.contracts import DuplexFence, DuplexSessionError, SessionRuntimeConfig
from shared.protocol.duplex import Commit, DuplexErrorEvent, SessionHeartbeatAck


class Store:
    """publish_many that succeeds, refuses (`fence`: [-2]) or waits (`gate` cleared)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, list[str]]] = []
        self.fence: set[str] = set()
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = asyncio.Event()
        self.client = None

    async def publish_many(self, writes, **_):
        self.calls.append({w.session_id: [i.wire_type for i in w.items] for w in writes})
        # Redis decides when the call runs; its reply may come back later (the gate)
        replies = {
            w.session_id: [-2] if w.session_id in self.fence else list(range(1, len(w.items) + 1))
            for w in writes
        }
        if not self.gate.is_set():
            self.waiting.set()
            await self.gate.wait()
        return replies


class Worker:
    """A manager and the Redis publisher on one table, as `WorkerProcess` composes them."""

    def __init__(self, max_sessions: int = 2, *, frames: bool = False) -> None:
        self.store = Store()
        self.table = SessionTable(max_sessions)
        self.publisher = RedisEventPublisher(
            self.store, self.table, max_bytes=1 << 20, ttl_s=60, closed_ttl_s=60
        )
        runtime = SessionRuntimeConfig(max_sessions=max_sessions)
        self.frames = frames
        if frames:  # a frame-clocked model on a clock that never moves: slots open, no tick
            plugin = EchoFramePlugin()
            port = TickBatchedStagePort.for_plugin(
                plugin, plugin.frame_model(max_sessions), clock=ManualClock()
            )
            self.manager = SessionManager(
                plugin, runtime, self.publisher, table=self.table, port=port
            )
        else:
            self.manager = SessionManager(EchoPlugin(), runtime, self.publisher, table=self.table)
        self.publisher.serve(self.manager.moves)
        self.publisher.start()

    async def open(self, **extra) -> str:
        if self.frames:
            opened = await self.manager.open({"duplex_surface": "openai", **extra})
        else:
            opened = await self.manager.open({"extra_body": {"pace": 0, **extra}})
        return opened.session_id

    async def settled(self) -> None:
        """Everything emitted is published and every background stop has ended."""
        await self.publisher.flush()
        await self.manager.builder.background_done()
        await self.publisher.flush()

    async def stop(self) -> None:
        await self.manager.shutdown()
        await self.publisher.stop()


@pytest.fixture(params=["echo", "frames"])
async def worker(request):
    """Each path runs on the echo plugin's task stage and on a frame model's tick stage."""
    w = Worker(frames=request.param == "frames")
    yield w
    await w.stop()


@pytest.fixture
async def echo_worker():
    """For the paths that need the echo plugin's own responses and options."""
    w = Worker()
    yield w
    await w.stop()


def records(table: SessionTable) -> list[str]:
    return [r.session_id for r in table]


def nothing_left(worker: Worker) -> bool:
    """No record, no slot, and nothing of any session in the stage."""
    port = worker.manager.builder.port
    held = port.held_sessions()
    return records(worker.table) == [] and not held and not worker.manager.table.slots_in_use


async def test_a_close_removes_the_record_once_session_closed_is_published(worker):
    sid = await worker.open()
    await worker.publisher.flush()
    worker.store.gate.clear()  # the next batch waits in Redis: the close happens mid-publish
    worker.publisher.emit(sid, SessionHeartbeatAck(session_id=sid))
    await worker.store.waiting.wait()
    await worker.manager.close(sid)
    record = worker.table.get(sid)
    assert record is not None and record.phase is Phase.GONE  # session.closed still to send
    assert worker.manager.table.slots_in_use == 0  # the slot is free already: the stage is clean
    worker.store.gate.set()
    await worker.settled()
    assert nothing_left(worker)
    assert worker.store.calls[-1][sid][-1] == "session.closed"


async def test_a_failed_batch_keeps_the_record_until_its_retry_lands(worker):
    sid = await worker.open()
    await worker.publisher.flush()
    failing = worker.store.publish_many
    failures = 0

    async def redis_away(writes, **kwargs):
        nonlocal failures
        if failures < 2:
            failures += 1
            raise ConnectionError("redis away")
        return await failing(writes, **kwargs)

    worker.store.publish_many = redis_away
    await worker.manager.close(sid)
    assert sid in worker.table  # its session.closed is not in Redis yet
    await worker.settled()
    assert failures == 2 and nothing_left(worker)


async def test_an_expiry_removes_the_record(worker):
    sid = await worker.open()
    await worker.manager.expire(sid, "idle_timeout")
    await worker.settled()
    assert nothing_left(worker)


async def test_a_fenced_session_is_dropped_mid_response_and_nothing_of_it_stays(echo_worker):
    sid = await echo_worker.open(pace=1)  # real time: the response stays in flight
    for command in appends(sine(16_000, 1.0), 16_000):
        await echo_worker.manager.submit(sid, command)
    await echo_worker.manager.submit(sid, Commit(create_response=True))
    async with asyncio.timeout(10):
        while not any("response.created" in call.get(sid, []) for call in echo_worker.store.calls):
            await echo_worker.publisher.flush()
            await asyncio.sleep(0.01)
    echo_worker.store.fence.add(sid)
    async with asyncio.timeout(10):
        while sid in echo_worker.table.live_ids():  # its next delta is refused: dropped
            await asyncio.sleep(0.01)
    await echo_worker.settled()
    assert nothing_left(echo_worker)


async def test_a_hand_off_keeps_the_record_while_a_drain_holds_messages_back(worker):
    sid = await worker.open()
    record = worker.table.get(sid)
    record.kept_back = []  # a drain is moving it: its inbox messages wait here
    checkpoint = await worker.manager.moves.hand_off(sid)
    assert orjson.loads(checkpoint)["session_id"] == sid
    assert await worker.publisher.write_checkpoint(sid, checkpoint)
    await worker.settled()
    assert records(worker.table) == [sid]  # the messages kept back are not sent on yet
    assert worker.manager.table.slots_in_use == 0
    record.kept_back = None  # sent on to the new worker (`Drain._let_go`)
    assert worker.table.settle(record)
    assert nothing_left(worker)


async def test_a_close_that_lands_while_a_hand_off_settles_leaves_nothing(worker):
    sid = await worker.open()
    record = worker.table.get(sid)
    record.kept_back = []
    handing = asyncio.create_task(worker.manager.moves.hand_off(sid))
    await worker.manager.close(sid)  # the client's close wins: the hand-off is refused
    with pytest.raises(DuplexSessionError) as refused:
        await handing
    assert refused.value.code in ("session_closed", "unknown_session")
    record.kept_back = None
    worker.table.settle(record)
    await worker.settled()
    assert nothing_left(worker)


@pytest.mark.parametrize("step", ["checkpoint", "plugin", "stage"])
async def test_a_restore_refused_at_any_step_leaves_no_record(worker, monkeypatch, step):
    source = Worker()
    try:
        sid = await source.open()
        data = source.manager.moves.snapshot(sid)
    finally:
        await source.stop()
    if step == "checkpoint":
        data = b"not a checkpoint"
    elif step == "plugin":

        async def refuse(*args):
            from shared.contracts import DuplexRuntimeConfigError

            raise DuplexRuntimeConfigError("bad_state", "the plugin refuses this state")

        monkeypatch.setattr(worker.manager.builder.plugin, "import_session_state", refuse)
    else:

        async def stage_away(*args):
            raise DuplexSessionError("stage_unavailable", "the stage is gone")

        monkeypatch.setattr(worker.manager.builder.port, "ensure", stage_away)
    with pytest.raises(DuplexSessionError):
        await worker.manager.moves.restore(sid, data, owner_generation=2, reason="worker_lost")
    assert nothing_left(worker)


async def test_a_restore_in_flight_holds_a_slot_and_a_refused_open_publishes_its_error(worker):
    source = Worker()
    try:
        sid = await source.open()
        data = source.manager.moves.snapshot(sid)
    finally:
        await source.stop()
    gate = asyncio.Event()
    ensure = worker.manager.builder.port.ensure

    async def slow_stage(*args):
        await gate.wait()
        return await ensure(*args)

    worker.manager.builder.port.ensure = slow_stage  # type: ignore[method-assign]
    restoring = asyncio.create_task(
        worker.manager.moves.restore(sid, data, owner_generation=2, reason="drain")
    )
    async with asyncio.timeout(10):
        while sid not in worker.table:
            await asyncio.sleep(0)
    assert worker.table.get(sid).phase is Phase.RESERVED and worker.manager.table.slots_in_use == 1
    with pytest.raises(DuplexSessionError) as twice:
        await worker.manager.open({}, session_id=sid)
    assert twice.value.code == "session_exists"
    gate.set()
    await restoring
    assert worker.table.get(sid).phase is Phase.LIVE
    await worker.manager.close(sid)
    # an open refused: its error goes out for a session that is not held here, then nothing
    worker.manager.builder.port.ensure = ensure  # type: ignore[method-assign]
    refused = "duplex-refused"
    worker.publisher.emit_unowned(refused, DuplexErrorEvent.for_code("bad_event", "no"))
    await worker.settled()
    assert nothing_left(worker)
    assert [call[refused] for call in worker.store.calls if refused in call] == [["error"]]


async def test_shutdown_leaves_an_empty_table(worker):
    for _ in range(2):
        await worker.open()
    await worker.manager.shutdown()
    await worker.publisher.flush()
    assert nothing_left(worker)


# ---------------------------------------------------------------- records replaced, late replies


async def test_an_open_over_a_refusal_still_being_published_is_a_fresh_session(worker):
    """The record that carries an open's refusal becomes the next open's: its stage is not
    clean (a failed cleanup keeps the slot held, for the reaper) and its order is new."""
    sid = "duplex-again"
    worker.store.gate.clear()  # the refusal's error stays in flight
    worker.publisher.emit_unowned(sid, DuplexErrorEvent.for_code("bad_event", "refused"))
    await worker.store.waiting.wait()
    await worker.manager.open({"extra_body": {"pace": 0}}, session_id=sid)
    record = worker.table.get(sid)
    assert record.phase is Phase.LIVE and not record.stage_clean
    cleanup = worker.manager.builder.port.cleanup

    async def stage_refuses(session_id):
        raise RuntimeError("stage cleanup failed")

    worker.manager.builder.port.cleanup = stage_refuses  # type: ignore[method-assign]
    worker.store.gate.set()
    await worker.manager.close(sid)
    await worker.settled()
    assert records(worker.table) == [sid] and worker.manager.table.slots_in_use == 1  # still held
    worker.manager.builder.port.cleanup = cleanup  # type: ignore[method-assign]
    await worker.manager.reap_once()  # the reaper's retry gives the slot back
    assert nothing_left(worker)


async def test_a_failed_batch_of_a_given_up_record_does_not_hide_the_next_one(worker):
    sid = "duplex-refused-twice"
    publish = worker.store.publish_many
    failed = False

    async def fails_once(writes, **kwargs):
        nonlocal failed
        replies = await publish(writes, **kwargs)
        if not failed:
            failed = True
            raise ConnectionError("redis away")
        return replies

    worker.store.publish_many = fails_once
    worker.store.gate.clear()
    worker.publisher.emit_unowned(sid, DuplexErrorEvent.for_code("bad_event", "first"))
    await worker.store.waiting.wait()
    with pytest.raises(DuplexSessionError):
        await worker.manager.open({"modalities": 7}, session_id=sid)  # refused: bad config
    worker.publisher.emit_unowned(sid, DuplexErrorEvent.for_code("bad_event", "second"))
    worker.store.gate.set()
    await worker.settled()
    assert nothing_left(worker)
    published = [call[sid] for call in worker.store.calls[1:] if sid in call]
    assert sum(len(types) for types in published) == 2  # both refusals went out


async def test_a_late_fenced_reply_does_not_drop_the_session_restored_here_since(worker):
    sid = await worker.open()
    await worker.publisher.flush()
    data = worker.manager.moves.snapshot(sid)
    worker.store.fence.add(sid)
    worker.store.gate.clear()  # a batch at owner generation 1 is out when...
    worker.publisher.emit(sid, SessionHeartbeatAck(session_id=sid))
    await worker.store.waiting.wait()
    worker.manager.moves.drop(sid, "the sweep moved it")  # ...the zombie check drops it
    await worker.manager.builder.background_done()
    assert sid not in worker.table
    await worker.manager.moves.restore(sid, data, owner_generation=3, reason="drain")
    worker.store.fence.discard(sid)  # generation 3 is the owner now
    worker.store.gate.set()  # the old batch's refusal ([-2]) comes back late
    await worker.settled()
    record = worker.table.get(sid)
    assert record.phase is Phase.LIVE and not record.fenced and sid in worker.table.live_ids()


async def test_a_handed_off_record_waits_for_its_final_checkpoint(worker):
    sid = await worker.open()
    await worker.publisher.flush()
    checkpoint = await worker.manager.moves.hand_off(sid)
    await worker.settled()
    assert records(worker.table) == [sid]  # its final checkpoint is still to be written
    assert await worker.publisher.write_checkpoint(sid, checkpoint)
    await worker.settled()
    assert nothing_left(worker)


async def test_a_failed_removal_from_the_worker_set_does_not_publish_the_batch_again(worker):
    class Client:
        async def srem(self, *args):
            raise ConnectionError("blip")

    worker.store.client = Client()
    worker.publisher.sessions_key = "duplex:worker:w:sessions"
    sid = await worker.open()
    await worker.manager.close(sid)
    await worker.settled()
    closed = [call[sid] for call in worker.store.calls if "session.closed" in call.get(sid, [])]
    assert len(closed) == 1 and nothing_left(worker)


# ---------------------------------------------------------------- the tick stage's slot state


@pytest.fixture
async def frame_worker():
    w = Worker(frames=True)
    yield w
    await w.stop()


async def test_a_slot_whose_close_failed_is_held_until_the_reaper_closes_it(frame_worker):
    """The session's slot state (`SlotState`, closing) is all the stage keeps of it: while
    its `close_slot` fails, the slot is neither free nor stepped, the record waits for a
    clean stage, and the reaper's retry frees both."""
    worker = frame_worker
    port = worker.manager.builder.port
    model = port.model
    sid = await worker.open()
    async with asyncio.timeout(10):  # its stream opened the slot in the model
        while (slot := port.slot_of(sid)) is None or not model.opened[slot]:
            await asyncio.sleep(0.01)
    close_slot = model.close_slot
    failures = []

    def fails_once(slot):
        if not failures:
            failures.append(slot)
            raise RuntimeError("the device is busy")
        close_slot(slot)

    model.close_slot = fails_once
    await worker.manager.close(sid)
    await worker.settled()
    assert failures and port.held_sessions() == {sid} and port.free_slots == model.slots - 1
    assert records(worker.table) == [sid]  # the record waits for a clean stage
    await worker.manager.reap_once()
    await worker.settled()
    assert nothing_left(worker) and port.free_slots == model.slots


async def test_the_reaper_cleans_up_what_the_stage_holds_of_a_session_with_no_record(worker):
    """A leak (the stage holding a session the table does not know) does not hold a slot
    until the worker restarts: the reaper's sweep cleans it up."""
    live = await worker.open()
    port = worker.manager.builder.port
    port.bind("duplex-stray", lambda output: None)
    await port.ensure(
        DuplexFence("duplex-stray", 1, 1), worker.manager.builder.plugin.stage_roles[0]
    )
    assert port.held_sessions() == {live, "duplex-stray"}
    await worker.manager.reap_once()
    assert port.held_sessions() == {live}  # the live session keeps its slot


async def test_a_session_bound_but_never_given_a_slot_leaves_nothing(frame_worker):
    """A restore refused before its slot was taken: the stage's record of it (its sink
    alone) goes with its cleanup."""
    worker = frame_worker
    port = worker.manager.builder.port
    port.bind("duplex-bound", lambda output: None)
    assert port.held_sessions() == {"duplex-bound"} and port.slot_of("duplex-bound") is None
    await port.cleanup("duplex-bound")
    assert not port.held_sessions() and port.free_slots == port.model.slots


async def test_the_record_holds_a_model_native_sessions_history(frame_worker):
    """The history the stage appends each stepped frame to is the record's own (what the
    publisher writes and a move carries), not one reached through the runner's parts."""
    worker = frame_worker
    sid = await worker.open()
    record = worker.table.get(sid)
    assert record.history is not None
    assert worker.manager.moves.model_history(sid) is record.history
    record.history.append(bytes(record.history.record_bytes))
    assert record.history.frames == 1
    await worker.manager.close(sid)
    await worker.settled()
    assert nothing_left(worker)
