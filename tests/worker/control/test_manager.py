"""Admission, close, expiry, unknown sessions and backpressure."""

import asyncio

import pytest

from harness.sessions import FAST, appends, make_harness, send_all, sine, types
from plugins.echo import EchoPlugin, EchoStagePort
from shared.contracts import DuplexSessionError, StageCleanupError
from shared.protocol.duplex import AppendAudio, Commit, Heartbeat


async def refused(coro) -> DuplexSessionError:
    with pytest.raises(DuplexSessionError) as info:
        await coro
    return info.value


async def test_open_emits_session_created_with_the_session_object(harness):
    session = await harness.client.open(
        {"model": "echo", "id": "client-chosen", "extra_body": {"pace": 0}}
    )
    assert session.session_id.startswith("duplex-") and len(session.session_id) == 39
    assert session.session["id"] == session.session_id  # the client's id is ignored
    assert session.session["object"] == "realtime.session" and session.session["state"] == "open"
    assert session.session["epoch"] == 0 and session.session["turn_state"] == "idle"
    caps = session.session["capabilities"]
    assert (
        caps["supports_session_resume"]
        and caps["supports_barge_in"]
        and caps["supports_chat_completions"]
    )
    assert caps["implementation_level"] == "turn_based_duplex" and caps["input_modes"] == [
        "append_audio_chunk"
    ]


async def test_close_is_idempotent_and_session_closed_is_last(harness):
    session = await harness.open()
    await session.send(Heartbeat(event_id="h"))
    await session.close()
    events = await session.until("session.closed")
    await harness.manager.close(session.session_id)  # second close: no second event
    assert types(events) == ["session.heartbeat_ack", "session.closed"]
    assert events[-1].reason == "client_close" and events[-1].session_id == session.session_id
    await asyncio.sleep(0)
    assert session.pending() == []
    assert harness.manager.table.slots_in_use == 0
    error = await refused(session.send(Heartbeat()))
    assert error.code == "unknown_session"


async def test_unknown_session(harness):
    error = await refused(harness.manager.submit("duplex-nope", Heartbeat(event_id="x")))
    assert (error.code, error.error_type) == ("unknown_session", "invalid_request_error")
    assert (await refused(harness.manager.touch("duplex-nope"))).code == "unknown_session"
    await harness.manager.close("duplex-nope")  # closing an unknown id is a no-op


async def test_admission_limit_is_resource_exhausted_and_retryable():
    h = make_harness(max_sessions=2)
    try:
        await h.open()
        await h.open()
        error = await refused(h.client.open(FAST))
        assert error.code == "resource_exhausted" and error.retryable is True
        assert error.error_type == "rate_limit_error"
        assert error.message == "duplex_session_capacity_exhausted: limit=2"
        wire = error.to_event().to_dict()["error"]
        assert wire["retryable"] is True and wire["type"] == "rate_limit_error"
    finally:
        await h.manager.shutdown()


class SlowOpenPlugin(EchoPlugin):
    async def prepare_runtime_config(self, config):
        await asyncio.sleep(0.01)  # opens overlap while this is awaited
        return await super().prepare_runtime_config(config)


async def test_concurrent_opens_never_exceed_the_limit():
    h = make_harness(plugin=SlowOpenPlugin(), max_sessions=3)
    try:
        results = await asyncio.gather(
            *(h.client.open(FAST) for _ in range(8)), return_exceptions=True
        )
        opened = [r for r in results if not isinstance(r, Exception)]
        refusals = [r for r in results if isinstance(r, DuplexSessionError)]
        assert len(opened) == 3 and len(refusals) == 5
        assert {r.code for r in refusals} == {"resource_exhausted"}
        assert h.manager.table.slots_in_use == 3
    finally:
        await h.manager.shutdown()


class FlakyCleanupPort(EchoStagePort):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.attempts = 0

    async def cleanup(self, session_id: str) -> None:
        self.attempts += 1
        if self.failures:
            self.failures -= 1
            raise StageCleanupError("engine unreachable")
        await super().cleanup(session_id)


async def test_closing_session_keeps_its_slot_until_cleanup_succeeds():
    port = FlakyCleanupPort(failures=2)
    h = make_harness(port=port, max_sessions=1)
    try:
        session = await h.open()
        await session.close()
        closed = (await session.until("session.closed"))[-1]
        assert closed.event["cleaned"] is False  # emitted even though the cleanup failed
        assert h.manager.table.slots_in_use == 1
        assert (await refused(h.client.open(FAST))).code == "resource_exhausted"
        assert (await refused(session.send(Heartbeat()))).code == "session_closed"
        await h.manager.reap_once()  # retry fails again
        assert h.manager.table.slots_in_use == 1
        await h.manager.reap_once()  # retry succeeds: the slot is free
        assert port.attempts == 3 and h.manager.table.slots_in_use == 0
        await h.open()
    finally:
        await h.manager.shutdown()


async def test_idle_ttl_expiry():
    h = make_harness(idle_ttl_s=30.0)
    try:
        session = await h.open()
        h.clock.now += 29
        assert await h.manager.reap_once() == []
        await session.send(Heartbeat())  # activity pushes the deadline
        await session.until("session.heartbeat_ack")
        h.clock.now += 29
        assert await h.manager.reap_once() == []
        h.clock.now += 2
        assert await h.manager.reap_once() == [(session.session_id, "idle_ttl_expired")]
        events = await session.until("session.closed")
        assert types(events) == ["session.expired", "session.closed"]
        assert events[0].reason == "idle_ttl_expired" and events[1].reason == "timeout"
    finally:
        await h.manager.shutdown()


async def test_the_worker_expires_only_idle_sessions_the_grace_is_redis():
    """Detach, resume and the disconnect grace live in Redis (lease_detach.lua, the
    janitor): the worker's reaper only expires sessions idle past their TTL."""
    h = make_harness(idle_ttl_s=None)
    try:
        session = await h.open()
        h.clock.now += 10_000
        assert await h.manager.reap_once() == []  # idle TTL disabled: nothing expires
        assert h.manager.table.live_ids() == [session.session_id]
        assert not hasattr(h.manager, "detach") and not hasattr(h.manager, "resume")
    finally:
        await h.manager.shutdown()


async def test_reaper_loop_survives_failures(monkeypatch):
    h = make_harness(reaper_interval_s=0.01)
    calls = []

    async def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return []

    monkeypatch.setattr(h.manager, "reap_once", flaky)
    h.manager.start()
    try:
        for _ in range(200):
            if len(calls) >= 3:
                break
            await asyncio.sleep(0.01)
        assert len(calls) >= 3
    finally:
        await h.manager.shutdown()


async def test_input_backpressure_by_bytes():
    # a reservation is the decoded size: 32 000 pcm16 bytes are 16 000 float32 samples, 64 000 bytes
    h = make_harness(max_pending_input_bytes_per_session=100_000)
    try:
        session = await h.open()
        chunk = AppendAudio(audio=bytes(32_000), format="pcm16", sample_rate_hz=16000)
        await session.send(chunk)
        await session.send(
            AppendAudio(audio=bytes(32_000), format="pcm16", sample_rate_hz=16000, event_id="over")
        )
        error = (await session.until("error"))[-1]
        assert (error.code, error.related_event_id, error.error_type) == (
            "input_backpressure",
            "over",
            "rate_limit_error",
        )
        # buffered (uncommitted) audio counts too: 16 000 samples are 64 000 float32 bytes
        await session.send({"type": "input_audio_buffer.clear"})  # after the first chunk is applied
        assert types(await session.until("input_audio_buffer.cleared")) == [
            "input_audio_buffer.speech_started",
            "input_audio_buffer.cleared",
        ]
        await session.send(chunk)
        await session.send({"type": "input.commit"})
        events = await session.until("rate_limits.updated")
        assert "error" not in types(events)
    finally:
        await h.manager.shutdown()


async def test_input_backpressure_by_pending_turns():
    h = make_harness(max_pending_turns_per_session=1)
    try:
        session = await h.open()
        await send_all(session, appends(sine(16000, 0.1), 16000))
        await session.send(Commit(create_response=False, event_id="first"))
        await session.send(
            Commit(create_response=False, event_id="second")
        )  # before the first is processed
        events = await session.until("error")
        assert events[-1].code == "input_backpressure" and events[-1].related_event_id == "second"
        await session.until("conversation.item.done")
        await session.send(Commit(event_id="later"))  # the reservation was released
        assert (await session.recv()).code == "input_audio_buffer_empty"
    finally:
        await h.manager.shutdown()


async def test_heartbeat_ack(harness):
    session = await harness.open()
    await session.send({"type": "session.heartbeat"})
    ack = await session.recv()
    assert ack.wire_type == "session.heartbeat_ack" and ack.session_id == session.session_id


async def test_invalid_config_is_refused_at_open(harness):
    error = await refused(harness.client.open({"turn_detection": {"type": "turn_vad"}}))
    assert error.code == "unsupported_turn_detection"
    error = await refused(harness.client.open({"extra_body": {"pace": -1}}))
    assert error.code == "invalid_duplex_runtime_config"
    assert harness.manager.table.slots_in_use == 0  # a refused open releases its slot


async def test_shutdown_closes_every_session():
    h = make_harness()
    one, two = await h.open(), await h.open()
    await h.manager.shutdown()
    for session in (one, two):
        closed = (await session.until("session.closed"))[-1]
        assert closed.reason == "shutdown"


async def test_a_chat_completion_holds_a_slot_while_it_runs():
    h = make_harness(max_sessions=1)
    try:
        assert await h.manager.chat_completion([{"role": "user", "content": "hi"}]) == "echo: hi"
        await h.open()
        error = await refused(h.manager.chat_completion([{"role": "user", "content": "hi"}]))
        assert error.code == "resource_exhausted"
        assert h.manager.table.slots_in_use == 1
    finally:
        await h.manager.shutdown()
