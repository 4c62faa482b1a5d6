"""Checkpoints: an exact round trip of a session's state, the plugin's hook pair, and the
`applied` mark, exact while input work is in flight."""

import threading

import orjson

from harness.sessions import FAST, appends, make_harness, send_all, sine
from plugins.echo import EchoPlugin
from services.worker.engine.checkpoint import (
    export_checkpoint,
    read_checkpoint,
    session_from_checkpoint,
)
from services.worker.engine.command_marks import CommandMarks
from services.worker.engine.lease import LeaseState
from shared.contracts import DuplexModelPlugin
from shared.protocol.duplex import (
    AckPlayback,
    AppendAudio,
    CancelInput,
    Commit,
    CreateItem,
    Heartbeat,
    float_to_pcm16,
)
from tests.worker.session_parts import RATE


def reimport(data: bytes, plugin=None):
    plugin = plugin or EchoPlugin()
    return session_from_checkpoint(
        read_checkpoint(data),
        capabilities=plugin.capabilities(4),
        lease=LeaseState(None),
        input_rate_hz=plugin.input_sample_rate_hz,
        output_rate_hz=plugin.output_sample_rate_hz,
    )


async def test_round_trip_with_an_active_response_pending_turns_and_input(parts):
    """export -> import -> export gives the same bytes, every listed field included."""
    await parts.start_response()
    await parts.apply(parts.output("audio", 0.2, text="echo "))
    await parts.apply(parts.output("audio", 0.1, text="500"))
    session = parts.session
    session.active.playback.acknowledge(150.0, None, False)
    session.config = session.config.apply_update(
        {"instructions": "be brief", "extra_body": {"pace": 0, "mine": [1, 2]}}
    )
    parts.append(sine(RATE, 0.3))
    parts.commit(create_response=False)
    await parts.apply_next(2)  # a pending turn (committed, not answered)
    parts.append(sine(RATE, 0.25, hz=220))
    await parts.apply_next(1)  # uncommitted audio in the input ledger
    parts.input.append_text("typed")
    session.unanswered_items = 1
    session.input_generation = 3
    data = export_checkpoint(session, applied=(2, 17), model_state={"kv": "x"}, with_input=True)

    restored = reimport(data)
    again = export_checkpoint(restored, applied=(2, 17), model_state={"kv": "x"}, with_input=True)
    assert again == data
    doc = orjson.loads(data)
    assert doc["v"] == 1 and doc["session_id"] == session.session_id
    assert doc["applied"] == [2, 17] and doc["model_state"] == {"kv": "x"}
    assert doc["active"]["id"] == session.active.response_id
    assert doc["active"]["transcript"] == "echo 500" and len(doc["active"]["marks"]) == 2
    assert doc["active"]["playback"]["played_ms"] == 150.0
    assert [t["turn_id"] for t in doc["pending_turns"]] == [session.turn_id]
    assert doc["input"]["text"] == "typed" and doc["input_generation"] == 3
    assert restored.config == session.config  # extra_body and all
    assert restored.active is restored.responses[session.active.response_id]
    assert restored.pending_turns[0].audio.tolist() == session.pending_turns[0].audio.tolist()
    assert restored.input.peek().tolist() == session.input.peek().tolist()
    assert restored.input.stream_ms == session.input.stream_ms
    assert restored.conversation.items == session.conversation.items
    assert (restored.epoch, restored.turn_id, restored.turn_state) == (
        session.epoch,
        session.turn_id,
        session.turn_state,
    )
    # without `input` (every checkpoint but a drain's last) the ledger is not carried
    assert orjson.loads(export_checkpoint(session, applied=(0, 0)))["input"] is None


async def test_items_are_kept_without_inline_audio(parts):
    parts.session.conversation.add(
        {
            "id": "item_a",
            "type": "message",
            "role": "user",
            "content": [{"type": "input_audio", "audio": "AAAA", "transcript": "hi"}],
        }
    )
    doc = orjson.loads(export_checkpoint(parts.session, applied=(0, 0)))
    assert doc["items"][-1]["content"] == [{"type": "input_audio", "transcript": "hi"}]


async def test_a_manager_snapshot_round_trips_through_restore():
    a, b = make_harness(), make_harness()
    try:
        session = await a.open({"instructions": "hi", "extra_body": {"pace": 0}})
        await send_all(session, appends(sine(16_000, 0.2), 16_000))
        await session.send(Commit(create_response=True))
        await session.until("response.done")
        await session.send(AckPlayback(played_ms=100.0))
        await session.send(CreateItem(item={"type": "message", "role": "user", "content": []}))
        await session.until("conversation.item.done")
        await a.manager.submit(session.session_id, Heartbeat(), (1, 9))
        await session.until("session.heartbeat_ack")
        data = a.manager.moves.snapshot(session.session_id)
        applied = await b.manager.moves.restore(
            session.session_id, data, owner_generation=2, reason="drain"
        )
        assert applied == (1, 9)
        assert b.manager.moves.snapshot(session.session_id) == data
        assert b.manager.moves.owned_sessions() == {session.session_id: 2}
        assert a.manager.moves.owned_sessions() == {session.session_id: 1}
        assert b.manager.moves.model_of(session.session_id) == "echo"
    finally:
        await a.manager.shutdown()
        await b.manager.shutdown()


class StatefulPlugin(EchoPlugin):
    """A plugin with per-session model state: it exports it and gets it back."""

    def __init__(self) -> None:
        self.imported: list[tuple] = []

    def export_session_state(self, session_id):
        return {"cache": f"state of {session_id}"}

    async def import_session_state(self, session_id, state, history):
        self.imported.append((session_id, state, [item["id"] for item in history]))


async def test_plugin_hooks_default_and_overridden():
    plugin = EchoPlugin()
    assert DuplexModelPlugin.export_session_state is type(plugin).export_session_state
    assert plugin.export_session_state("s") is None
    assert await plugin.import_session_state("s", None, [{"id": "item_x"}]) is None

    stateful = StatefulPlugin()
    a, b = make_harness(stateful), make_harness(StatefulPlugin())
    try:
        session = await a.open()
        await session.send(CreateItem(item={"type": "message", "role": "user", "content": []}))
        item = (await session.until("conversation.item.done"))[-1].item
        data = a.manager.moves.snapshot(session.session_id)
        assert orjson.loads(data)["model_state"] == {"cache": f"state of {session.session_id}"}
        await b.manager.moves.restore(session.session_id, data, owner_generation=2, reason="drain")
        assert b.manager.builder.plugin.imported == [
            (session.session_id, {"cache": f"state of {session.session_id}"}, [item["id"]])
        ]
    finally:
        await a.manager.shutdown()
        await b.manager.shutdown()


def test_command_marks_applied_is_the_highest_complete_prefix():
    marks = CommandMarks((1, 3))
    marks.handled((0, 0))  # unmarked: never tracked
    marks.begin((1, 4))
    marks.begin((1, 5))
    marks.complete((1, 5))
    assert marks.applied == (1, 3)  # 4 still in flight
    marks.complete((1, 4))
    assert marks.applied == (1, 5)
    marks.begin((2, 1))  # a newer attachment
    marks.handled((2, 2))
    assert marks.applied == (1, 5)
    marks.complete((2, 1))
    assert marks.applied == (2, 2) and marks.in_flight == 0


async def test_applied_stays_before_an_append_in_flight_while_a_later_heartbeat_is_handled():
    h = make_harness()
    try:
        session = await h.open(FAST)
        runner = h.manager.table.runner(session.session_id)
        release = threading.Event()
        convert = runner.pipeline.convert

        def blocked(command, silence_rms):
            release.wait(10)
            return convert(command, silence_rms)

        runner.pipeline.convert = blocked
        big = AppendAudio(audio=float_to_pcm16(sine(16_000, 0.5)), format="pcm16")  # executor
        await h.manager.submit(session.session_id, Heartbeat(), (1, 1))
        await h.manager.submit(session.session_id, big, (1, 2))
        await h.manager.submit(session.session_id, Heartbeat(), (1, 3))
        await session.until("session.heartbeat_ack")
        await session.until("session.heartbeat_ack")  # the later heartbeat is handled
        assert runner.marks.applied == (1, 1)
        assert orjson.loads(h.manager.moves.snapshot(session.session_id))["applied"] == [1, 1]
        assert not h.manager.moves.is_idle(session.session_id)
        release.set()
        await runner.settle_input()
        assert runner.marks.applied == (1, 3)
        assert runner.session.input.samples == 8000
        assert h.manager.moves.is_idle(session.session_id)
    finally:
        release.set()
        await h.manager.shutdown()


async def test_refused_and_stale_commands_complete_their_marks():
    h = make_harness(max_pending_input_bytes_per_session=1000)
    try:
        session = await h.open(FAST)
        runner = h.manager.table.runner(session.session_id)
        big = AppendAudio(audio=float_to_pcm16(sine(16_000, 0.5)), format="pcm16")
        await h.manager.submit(session.session_id, big, (1, 1))  # refused: backpressure
        assert (await session.recv()).code == "input_backpressure"
        await h.manager.submit(session.session_id, Commit(), (1, 2))  # an empty buffer
        assert (await session.recv()).code == "input_audio_buffer_empty"
        assert runner.marks.applied == (1, 2)
        small = appends(sine(16_000, 0.02), 16_000)[0]
        await h.manager.submit(session.session_id, small, (1, 3))
        await h.manager.submit(session.session_id, CancelInput(), (1, 4))  # (1, 3) goes stale
        await session.until("input_audio_buffer.cleared")
        await runner.settle_input()
        assert runner.marks.applied == (1, 4) and runner.session.input.samples == 0
    finally:
        await h.manager.shutdown()


async def test_an_ordinary_checkpoint_stops_before_the_uncommitted_turns_first_append():
    """Its audio is not in an ordinary checkpoint: were the append counted as applied, a
    failover would drop it as done and lose the audio without telling the client."""
    h = make_harness()
    try:
        session = await h.open(FAST)
        sid = session.session_id
        runner = h.manager.table.runner(sid)
        await h.manager.submit(sid, Heartbeat(), (1, 1))
        first, second = appends(sine(16_000, 0.04), 16_000)[:2]
        await h.manager.submit(sid, first, (1, 2))
        await h.manager.submit(sid, second, (1, 3))
        await h.manager.submit(sid, Heartbeat(), (1, 4))
        await runner.settle_input()
        assert runner.marks.applied == (1, 4)
        assert orjson.loads(h.manager.moves.snapshot(sid))["applied"] == [1, 1]
        # a drain's final checkpoint carries the audio, and so the appends
        drained = orjson.loads(export_checkpoint(runner.session, applied=(1, 4), with_input=True))
        assert drained["applied"] == [1, 4] and drained["input"]["first_mark"] == [1, 2]
        await h.manager.submit(sid, Commit(create_response=True), (1, 5))
        await session.until("response.done")
        assert orjson.loads(h.manager.moves.snapshot(sid))["applied"] == [1, 5]
    finally:
        await h.manager.shutdown()
