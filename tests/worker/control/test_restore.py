"""A session moved to another worker: restored from its checkpoint, it goes on there; a
drain's hand-off keeps the uncommitted turn; a failover fails the response in flight."""

import orjson
import pytest

from harness.sessions import FAST, appends, make_harness, send_all, sine, types
from shared.client.inline import InlineSession
from shared.contracts import DuplexSessionError
from shared.protocol.duplex import Commit, Heartbeat, SignalTurn


@pytest.fixture
async def two():
    a, b = make_harness(), make_harness(max_sessions=1)
    yield a, b
    await a.manager.shutdown()
    await b.manager.shutdown()


def attach(h, session_id: str) -> InlineSession:
    """The client's view of a session restored on `h` (it sees no session.created)."""
    return InlineSession(h.manager, h.router, session_id, {})


async def turn(session, seconds: float) -> list:
    await send_all(session, appends(sine(16_000, seconds), 16_000))
    await session.send(Commit(create_response=True))
    return await session.until("response.done")


async def test_a_restored_session_answers_the_next_turn(two):
    a, b = two
    session = await a.open()
    await turn(session, 0.3)
    before = a.manager.table.runner(session.session_id).session.conversation.items
    data = a.manager.moves.snapshot(session.session_id)
    await b.manager.moves.restore(
        session.session_id, data, owner_generation=2, reason="worker_lost"
    )
    moved = attach(b, session.session_id)
    assert moved.pending() == []  # no session.created, nothing else
    events = await turn(moved, 0.4)
    done = events[-1]
    assert done.response["status"] == "completed"
    assert done.response["output"][0]["content"][0]["transcript"] == "echo 400 ms"
    items = b.manager.table.runner(session.session_id).session.conversation.items
    assert items[:2] == before and len(items) == 4  # the first turn and its answer came along
    assert b.manager.table.slots_in_use == 1
    with pytest.raises(DuplexSessionError) as refused:
        await b.manager.moves.restore("duplex-other", data, owner_generation=2, reason="drain")
    assert refused.value.code == "resource_exhausted"


async def test_worker_lost_fails_the_response_in_flight_and_keeps_it_out_of_history(two):
    a, b = two
    session = await a.open({"extra_body": {"pace": 1}})  # real time: it stays in flight
    await send_all(session, appends(sine(16_000, 2.0), 16_000))
    await session.send(Commit(create_response=True))
    created = (await session.until("response.created"))[-1]
    await session.until("response.output_audio.delta")
    data = a.manager.moves.snapshot(session.session_id)
    response_id = created.response["id"]
    assert orjson.loads(data)["active"]["id"] == response_id

    await b.manager.moves.restore(
        session.session_id, data, owner_generation=3, reason="worker_lost"
    )
    moved = attach(b, session.session_id)
    chain = await moved.until("error")
    assert types(chain) == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
        "rate_limits.updated",
        "error",
    ]
    done, error = chain[-3], chain[-1]
    assert done.response["id"] == response_id and done.response["status"] == "failed"
    assert done.response["status_details"]["reason"] == "worker_lost"
    assert done.response["status_details"]["error"] == {
        "type": "server_error",
        "code": "worker_lost",
        "retryable": True,
    }
    assert done.response["metadata"]["committed"] is False
    assert error.code == "worker_lost" and error.retryable is True
    restored = b.manager.table.runner(session.session_id).session
    item_id = "item_" + response_id
    assert item_id not in [item["id"] for item in restored.conversation.items]
    assert restored.active is None and restored.turn_state == "idle"
    await moved.send(SignalTurn(event="conversation.item.retrieve", payload={"item_id": item_id}))
    assert (await moved.recv()).code == "item_not_found"
    # the next turn is answered on the new worker
    assert (await turn(moved, 0.1))[-1].response["status"] == "completed"


async def test_hand_off_keeps_the_uncommitted_turn_and_restore_puts_it_back(two):
    a, b = two
    session = await a.open(FAST)
    sid = session.session_id
    await send_all(session, appends(sine(16_000, 0.3), 16_000))
    await a.manager.submit(sid, Heartbeat(), (1, 7))
    # no wait: the appends are still in flight when the hand-off starts
    data = await a.manager.moves.hand_off(sid)
    saved = orjson.loads(data)["input"]
    assert saved is not None and len(saved["audio"]) > 0
    assert orjson.loads(data)["applied"] == [1, 7]
    assert sid not in a.manager.table.live_ids() and a.manager.table.slots_in_use == 0
    assert sid not in a.manager.moves.owned_sessions()
    assert "session.closed" not in types(session.pending())
    assert a.manager.moves.snapshot(sid) is None

    applied = await b.manager.moves.restore(sid, data, owner_generation=2, reason="drain")
    assert applied == (1, 7)
    moved = attach(b, sid)
    await send_all(moved, appends(sine(16_000, 0.2), 16_000))
    await moved.send(Commit(create_response=True))
    done = (await moved.until("response.done"))[-1]
    assert done.response["output"][0]["content"][0]["transcript"] == "echo 500 ms"


async def test_drop_emits_nothing_and_frees_the_slot(two):
    a, _ = two
    session = await a.open({"extra_body": {"pace": 1}})
    await send_all(session, appends(sine(16_000, 1.0), 16_000))
    await session.send(Commit(create_response=True))
    await session.until("response.created")
    runner = a.manager.table.runner(session.session_id)
    a.manager.moves.drop(session.session_id, "fenced out in a test")
    a.manager.moves.drop(session.session_id, "twice")  # idempotent
    assert session.session_id not in a.manager.moves.owned_sessions()
    await a.manager.shutdown()  # waits for the drop's stage cleanup
    assert not runner.running and a.manager.table.slots_in_use == 0
    after = types(session.pending())
    assert "response.done" not in after and "session.closed" not in after


async def test_cancel_active_report_lost_commands_and_is_idle(two):
    a, _ = two
    session = await a.open({"extra_body": {"pace": 1}})
    sid = session.session_id
    assert a.manager.moves.is_idle(sid)
    await send_all(session, appends(sine(16_000, 1.0), 16_000))
    await session.send(Commit(create_response=True))
    await session.until("response.created")
    assert not a.manager.moves.is_idle(sid)
    await a.manager.moves.cancel_active(sid)
    done = (await session.until("response.done"))[-1]
    assert done.response["status"] == "cancelled"
    assert done.response["status_details"]["reason"] == "shutdown"
    assert a.manager.moves.is_idle(sid)
    a.manager.moves.report_lost_commands(sid, 3)
    error = (await session.until("error"))[-1]
    assert (error.code, error.retryable, error.extra["lost_commands"]) == ("input_lost", True, 3)


async def test_an_unreadable_checkpoint_is_refused_and_holds_no_slot(two):
    _, b = two
    for data in (b"not json", b'{"v": 99}', orjson.dumps({"v": 1, "session_id": "duplex-x"})):
        with pytest.raises(DuplexSessionError) as refused:
            await b.manager.moves.restore(
                "duplex-x", data, owner_generation=2, reason="worker_lost"
            )
        assert refused.value.code == "worker_lost"
    assert b.manager.table.slots_in_use == 0


async def test_a_restore_that_fails_once_registered_keeps_no_runner_or_slot(two, monkeypatch):
    """Were the runner left behind, the session would hold a slot and sit unserved here
    while the caller closes it (worker_lost) for want of a worker."""
    a, b = two
    session = await a.open(FAST)
    data = a.manager.moves.snapshot(session.session_id)

    def broken(self, first_event=None):
        raise RuntimeError("the runner could not start")

    monkeypatch.setattr("services.worker.engine.runner.SessionRunner.start", broken)
    with pytest.raises(RuntimeError):
        await b.manager.moves.restore(session.session_id, data, owner_generation=2, reason="drain")
    assert b.manager.table.slots_in_use == 0
    assert b.manager.table.live_ids() == [] and b.manager.moves.owned_sessions() == {}
