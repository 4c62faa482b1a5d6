"""Attachment (services/api/attachment.py): its state table, the placement walk, resume, and
release writing the lease through the real Lua scripts (fakeredis)."""

import asyncio
import itertools

import fakeredis
import orjson
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from services.api.attachment import (
    TRANSITIONS,
    AttachFailed,
    Attachment,
    AttachmentState,
    AttachmentStateError,
)
from services.api.inbox_writer import InboxFull, InboxWriter
from services.api.live import CATCH_UP, LiveFeed
from shared.protocol.duplex import (
    SURFACE_MOSHI,
    AppendAudio,
    Commit,
    Heartbeat,
    SessionResume,
)
from shared.redis.boundary import CloseRequest, OpenRequest, TouchRequest
from shared.redis.store import PublishItem
from tests.api.parts import (
    JOURNAL,
    KEYS,
    POD,
    active_session,
    created,
    inbox,
    make_parts,
    publish,
    register_worker,
)

S = AttachmentState
EXHAUSTED = {"type": "error", "error": {"type": "server_error", "code": "resource_exhausted"}}


@pytest.fixture
async def parts():
    parts = make_parts()
    yield parts
    await parts.close()


def refuse_first(worker_id, session_id, session):
    """The first worker asked is full (a race with another pod); the next admits."""
    refuse_first.asked += 1
    return EXHAUSTED if refuse_first.asked == 1 else created(session_id)


async def api_sessions(parts) -> set[str]:
    return {m.decode() for m in await parts.client.smembers(KEYS.api_sessions(POD))}


async def opened(parts, *, resumable: bool = True) -> Attachment:
    await register_worker(parts.client, "w1", resumable=resumable)
    attachment = parts.attachment(LiveFeed())
    await attachment.open({}, None)
    return attachment


async def resumed(parts, sid: str, token: str, last_seq: int = 0) -> tuple[Attachment, str]:
    attachment = parts.attachment(LiveFeed())
    request = SessionResume(
        session_id=sid, resume_token=token, last_received_server_event_seq=last_seq
    )
    result = await attachment.resume(request)
    return attachment, result.resume_token


# ------------------------------------------------------------ the state table


def test_every_transition_the_table_does_not_list_raises_and_changes_nothing(parts):
    attachment = parts.attachment(LiveFeed())
    for start, target in itertools.product(S, S):
        attachment.state = start
        if target in TRANSITIONS[start]:
            attachment._move(target)
            assert attachment.state is target
        else:
            with pytest.raises(AttachmentStateError):
                attachment._move(target)
            assert attachment.state is start
    assert TRANSITIONS[S.RELEASED] == frozenset()  # terminal


async def test_what_an_attachment_without_a_session_cannot_do(parts):
    attachment = parts.attachment(LiveFeed())
    with pytest.raises(AttachmentStateError):
        attachment.created_delivered()  # no session.created can exist yet
    with pytest.raises(AttachmentStateError):
        await attachment.command(Heartbeat())
    assert attachment.live is False
    await attachment.release()
    assert attachment.state is S.RELEASED
    with pytest.raises(AttachmentStateError):  # a socket is attached once
        await attachment.resume(SessionResume(session_id="duplex-x", resume_token="t"))


async def test_an_attachment_opens_once(parts):
    attachment = await opened(parts)
    with pytest.raises(AttachmentStateError):
        await attachment.open({}, None)
    assert attachment.state is S.OPENED


# ------------------------------------------------------------ the placement walk


async def test_the_walk_goes_on_to_the_next_worker_when_the_first_is_full(parts):
    refuse_first.asked = 0
    parts.workers.answer = refuse_first
    await register_worker(parts.client, "w1")
    await register_worker(parts.client, "w2")
    attachment = parts.attachment(LiveFeed())
    reply = await attachment.open({"voice": "x"}, "echo")
    first, second = parts.workers.opens
    assert {first, second} == {"w1", "w2"}
    sid = attachment.session_id
    assert reply == {
        **created(sid),
        "resume_token": reply["resume_token"],
        "attachment_generation": 1,
        "duplex_worker_id": second,
    }
    assert isinstance(reply["resume_token"], str) and len(reply["resume_token"]) == 43
    assert (attachment.state, attachment.worker_id, attachment.generation) == (S.OPENED, second, 1)
    assert attachment.resumable is True and attachment.live is True
    for worker in (first, second):  # each was asked once, with the session object
        [entry] = await inbox(parts.client, worker)
        assert entry == OpenRequest(sid, {"voice": "x", "model": "echo"}, 1)
    meta = await parts.store.meta(sid)  # the refused worker's hash was deleted, then re-made
    assert (meta["worker"], meta["state"], meta["pod"]) == (second, "opening", POD)
    assert orjson.loads(meta["config"]) == {"voice": "x", "model": "echo"}
    assert await api_sessions(parts) == {sid}
    assert parts.liveness.attached == {sid: 1}
    assert parts.hub.listening(KEYS.live(sid))


async def test_a_worker_whose_heartbeat_is_too_old_is_never_asked(parts):
    await register_worker(parts.client, "dead", beat_age_s=60.0)
    await register_worker(parts.client, "alive")
    attachment = parts.attachment(LiveFeed())
    reply = await attachment.open({}, None)
    assert parts.workers.opens == ["alive"]
    assert reply["duplex_worker_id"] == "alive" and attachment.worker_id == "alive"
    assert await inbox(parts.client, "dead") == []


async def test_when_every_worker_is_full_nothing_is_left_behind(parts):
    parts.workers.answer = lambda worker, sid, session: EXHAUSTED
    await register_worker(parts.client, "w1")
    await register_worker(parts.client, "w2")
    attachment = parts.attachment(LiveFeed())
    with pytest.raises(AttachFailed) as failed:
        await attachment.open({}, None)
    assert failed.value.event.to_dict()["error"] == {
        "type": "rate_limit_error",
        "code": "resource_exhausted",
        "message": "every worker of this model is full",
        "retryable": True,
    }
    assert sorted(parts.workers.opens) == ["w1", "w2"]
    assert (attachment.state, attachment.session_id, attachment.worker_id) == (
        S.RELEASED,
        None,
        None,
    )
    assert await parts.client.keys(KEYS.session("*")) == []  # hashes deleted
    assert await api_sessions(parts) == set()
    sid = (await inbox(parts.client, "w1"))[0].session_id
    assert not parts.hub.listening(KEYS.live(sid)) and parts.liveness.attached == {}
    await attachment.release()  # nothing left to release
    assert attachment.state is S.RELEASED


async def test_a_worker_that_never_answers_fails_the_open_without_walking_on(parts):
    parts.workers.answer = lambda worker, sid, session: None
    await register_worker(parts.client, "w1")
    await register_worker(parts.client, "w2")
    attachment = parts.attachment(LiveFeed(), open_timeout_s=0.05)
    with pytest.raises(AttachFailed) as failed:
        await attachment.open({}, None)
    error = failed.value.event.to_dict()["error"]
    assert (error["code"], error["message"]) == (
        "timeout",
        "the worker did not answer the open in time",
    )
    assert len(parts.workers.opens) == 1 and attachment.state is S.RELEASED
    assert await parts.client.keys(KEYS.session("*")) == []


async def test_a_worker_error_other_than_full_is_handed_back_as_it_came(parts):
    refusal = {"type": "error", "error": {"code": "invalid_session_config", "message": "no"}}
    parts.workers.answer = lambda worker, sid, session: refusal
    await register_worker(parts.client, "w1")
    attachment = parts.attachment(LiveFeed())
    with pytest.raises(AttachFailed) as failed:
        await attachment.open({}, None)
    assert failed.value.reply == refusal and failed.value.event is None
    assert attachment.state is S.RELEASED


@pytest.mark.parametrize(
    ("workers", "session", "code", "message"),
    [
        ([], {}, "resource_exhausted", "no live worker serves this model"),
        (
            ["w1"],
            {"model": "big"},
            "invalid_session_config",
            "model 'big' is not served; try ['echo']",
        ),
        (
            ["w1"],
            {"model": []},
            "invalid_session_config",
            "session.model must be a model name (a non-empty string)",
        ),
    ],
)
async def test_an_open_no_worker_can_take_asks_none(parts, workers, session, code, message):
    for worker in workers:
        await register_worker(parts.client, worker)
    attachment = parts.attachment(LiveFeed())
    with pytest.raises(AttachFailed) as failed:
        await attachment.open(session, None)
    error = failed.value.event.to_dict()["error"]
    assert (error["code"], error["message"]) == (code, message)
    assert parts.workers.opens == [] and attachment.state is S.NEW


@pytest.mark.parametrize(
    ("native", "session", "code", "message"),
    [
        # only a cascade is live: the native one is starting, or restarting (retryable)
        (None, {}, "resource_exhausted", "no worker of a native full-duplex"),
        (None, {"model": "echo"}, "invalid_session_config", "model 'echo' is not a native"),
        ("full", {}, "resource_exhausted", "every worker of this model is full"),
    ],
)
async def test_a_native_surfaces_open_goes_to_a_native_model_or_says_why_not(
    parts, native, session, code, message
):
    """Moshi's and GPT-Live's surfaces (`native_only`): a cascade model's worker is never
    asked, whatever the ring says; why none can take the session decides the client's
    answer (a 400 stops LiveKit's PersonaPlex plugin for good, a 429 is waited on)."""
    await register_worker(parts.client, "cascade")
    if native:
        await register_worker(parts.client, "moshi-1", model="moshi", native=True, active=4)
    attachment = parts.attachment(LiveFeed())
    attachment.serve_surface(SURFACE_MOSHI)
    with pytest.raises(AttachFailed) as failed:
        await attachment.open(session, None)
    error = failed.value.event.to_dict()["error"]
    assert error["code"] == code and message in error["message"]
    assert parts.workers.opens == []


async def test_a_native_surfaces_open_passes_the_other_models_workers_over(parts):
    for index in range(4):  # the ring would put some of the sessions on these
        await register_worker(parts.client, f"cascade-{index}")
    await register_worker(parts.client, "moshi-1", model="moshi", native=True)
    for _ in range(4):
        attachment = parts.attachment(LiveFeed())
        attachment.serve_surface(SURFACE_MOSHI)
        await attachment.open({}, None)
    assert parts.workers.opens == ["moshi-1"] * 4


async def test_a_missed_session_created_is_read_from_the_hash_on_catch_up_or_timeout(parts):
    """No polling: the hash is read when the hub says it reconnected (CATCH_UP), or once
    when the open timeout runs out."""
    reads: list[str] = []
    real_meta = parts.store.meta

    async def meta(session_id: str) -> dict:
        reads.append(session_id)
        answer = await real_meta(session_id)
        if len(reads) == 1:  # the worker answers right after; its live message is lost
            session = orjson.dumps({"id": session_id, "model": "echo"})
            item = PublishItem(orjson.dumps(created(session_id)), "session.created", False, session)
            await parts.store.publish(session_id, [item], **JOURNAL)
        return answer

    parts.store.meta = meta
    feed = LiveFeed()
    attachment = parts.attachment(feed)
    attachment.session_id = "duplex-t"
    await parts.store.open("duplex-t", "w1", "echo", "", "{}", POD)
    feed.push(b"!takeover 2")  # control notices are skipped
    feed.push(CATCH_UP)  # reconnected, but the worker had not answered yet
    feed.push(CATCH_UP)  # reconnected again: now the hash has it
    reply = await attachment.first_reply()
    assert reply["type"] == "session.created"  # rebuilt from the hash, with an event id
    assert reply["session"] == {"id": "duplex-t", "model": "echo"}
    assert reads == ["duplex-t", "duplex-t"]  # one read per CATCH_UP, none on a timer
    attachment.session_id = "duplex-v"
    await parts.store.open("duplex-v", "w1", "echo", "", "{}", POD)
    reads.clear()
    attachment.open_timeout_s = 0.05
    assert await attachment.first_reply() is None  # timed out, and the hash has nothing
    assert reads == ["duplex-v"]  # read once, at the timeout


# ------------------------------------------------------------ resume


async def test_a_resume_with_a_wrong_token_is_refused_and_holds_nothing(parts):
    await active_session(parts.store, "duplex-r", token="right")
    await parts.store.detach("duplex-r", 1, 30_000)
    attachment = parts.attachment(LiveFeed())
    request = SessionResume(session_id="duplex-r", resume_token="wrong", event_id="ev1")
    with pytest.raises(AttachFailed) as failed:
        await attachment.resume(request)
    assert failed.value.event.to_dict()["error"] == {
        "type": "invalid_request_error",
        "code": "invalid_resume_token",
        "message": "cannot resume duplex-r: invalid_resume_token",
        "event_id": "ev1",
    }
    assert (attachment.state, attachment.session_id) == (S.RELEASED, None)
    meta = await parts.store.meta("duplex-r")
    assert (meta["state"], meta["attachment_generation"]) == ("detached", "1")
    assert not parts.hub.listening(KEYS.live("duplex-r")) and parts.liveness.attached == {}


async def test_a_resume_while_the_store_is_away_is_refused_as_retryable(parts, monkeypatch):
    """Redis failing over under the resume: nothing was taken over, and the client hears
    a retryable internal_error (it tries again) instead of a failure of the socket."""
    await active_session(parts.store, "duplex-r", token="right")
    await parts.store.detach("duplex-r", 1, 30_000)

    async def away(*args, **kwargs):
        raise RedisConnectionError("Error 111 connecting to 127.0.0.1:6379")

    monkeypatch.setattr(parts.store, "resume", away)
    attachment = parts.attachment(LiveFeed())
    request = SessionResume(session_id="duplex-r", resume_token="right", event_id="ev1")
    with pytest.raises(AttachFailed) as failed:
        await attachment.resume(request)
    refused = failed.value.event.to_dict()["error"]
    assert (refused["code"], refused["retryable"], refused["event_id"]) == (
        "internal_error",
        True,
        "ev1",
    )
    assert (attachment.state, attachment.session_id) == (S.RELEASED, None)
    assert not parts.hub.listening(KEYS.live("duplex-r"))


async def test_a_resume_past_an_overflowed_journal_asks_for_a_resync(parts):
    await active_session(parts.store, "duplex-r", token="tok")
    assert await publish(parts.store, "duplex-r", "response.created") == [1]
    await publish(parts.store, "duplex-r", "response.done", max_bytes=8)  # larger than the journal
    attachment = parts.attachment(LiveFeed())
    with pytest.raises(AttachFailed) as failed:
        await attachment.resume(SessionResume(session_id="duplex-r", resume_token="tok"))
    event = failed.value.event.to_dict()
    assert (event["type"], event["reason"]) == ("session.resync_required", "journal_overflow")
    assert attachment.state is S.RELEASED


async def test_a_resume_takes_the_lease_over_and_tells_the_old_socket(parts):
    await active_session(parts.store, "duplex-r", token="tok")
    await parts.hub.start()
    listener = parts.client.pubsub()
    await listener.subscribe(KEYS.live("duplex-r"))
    attachment, token = await resumed(parts, "duplex-r", "tok")
    assert (attachment.state, attachment.generation, attachment.worker_id) == (
        S.ATTACHED,
        2,
        "worker-a",
    )
    assert token != "tok"
    meta = await parts.store.meta("duplex-r")
    assert (meta["state"], meta["attachment_generation"], meta["pod"]) == ("active", "2", POD)
    assert parts.liveness.attached == {"duplex-r": 2}
    assert await api_sessions(parts) == {"duplex-r"}
    message = await listener.get_message(ignore_subscribe_messages=True, timeout=5.0)
    while message is None:
        message = await listener.get_message(ignore_subscribe_messages=True, timeout=5.0)
    assert message["data"] == b"!takeover 2"
    await listener.aclose()
    await attachment.touch()  # the worker hears it has a socket again
    [touch] = await inbox(parts.client, "worker-a")
    assert touch == TouchRequest("duplex-r", 2)
    assert attachment.taken_over(2) is False  # its own notice
    assert attachment.taken_over(3) is True and attachment.state is S.REPLACED


# ------------------------------------------------------------ commands


async def test_commands_carry_the_attachment_and_a_seq_and_a_heartbeat_touches_the_lease(parts):
    await active_session(parts.store, "duplex-r", token="tok")
    attachment, _ = await resumed(parts, "duplex-r", "tok")
    # a sweep took the session while this pod stalled: the heartbeat's touch, fenced on
    # the attachment's generation, takes it back (lease_touch.lua)
    assert await parts.store.detach("duplex-r", 2, 30_000, by="sweep") == 1
    await attachment.command(Heartbeat(event_id="h1"))
    meta = await parts.store.meta("duplex-r")
    assert (meta["state"], meta["pod"]) == ("active", POD)
    assert await parts.client.zscore(KEYS.leases(), "duplex-r") is None
    await attachment.command(Heartbeat(event_id="h2"))
    assert [(e.attachment, e.seq) for e in await inbox(parts.client, "worker-a")] == [
        (2, 1),
        (2, 2),
    ]
    assert await publish(parts.store, "duplex-r", "a", "b") == [1, 2]
    assert await attachment.acknowledge(2) is True
    assert await attachment.acknowledge(3) is False  # past the newest event


class FailingOnce(InboxWriter):
    """A real inbox writer that fails the next message as given (a full inbox, Redis gone)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail: Exception | None = None

    def send(self, worker_id, message, **kwargs):
        if self.fail is None:
            return super().send(worker_id, message, **kwargs)
        exc, self.fail = self.fail, None
        future = asyncio.get_running_loop().create_future()
        future.set_exception(exc)
        return future


async def test_a_command_the_full_inbox_refused_does_not_consume_its_seq():
    """The worker sees contiguous seqs: a seq gap means commands lost in a move (input_lost),
    so a refusal (nothing written) gives its seq back; an ambiguous failure does not. An
    append is not awaited: its failure reaches the client as an error with its event_id."""
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    parts = make_parts(inbox=FailingOnce(client, KEYS, max_bytes=4096), client=client)
    writer = parts.inbox
    try:
        await active_session(parts.store, "duplex-r", token="tok")
        attachment, _ = await resumed(parts, "duplex-r", "tok")
        heard = []
        attachment.commands.report = heard.append
        await attachment.command(Heartbeat(event_id="h1"))  # seq 1
        await attachment.command(AppendAudio(audio=b"\x00" * 8000, event_id="big"))
        with pytest.raises(InboxFull):  # over the real budget (inbox_append.lua refuses)
            await attachment.command(Commit(event_id="c1"))  # carried the append with it
        assert attachment.command_seq == 1
        await attachment.command(Heartbeat(event_id="h2"))  # seq 2
        writer.fail = RedisConnectionError("gone")  # may or may not have been written
        with pytest.raises(RedisConnectionError):
            await attachment.command(Heartbeat(event_id="h3"))
        writer.fail = InboxFull("full")
        await attachment.command(AppendAudio(audio=b"\x00" * 64, event_id="a4"))
        await attachment.command(Heartbeat(event_id="h5"))
        entries = await inbox(parts.client, "worker-a")
        assert [(e.seq, e.command.event_id) for e in entries] == [
            (1, "h1"),
            (2, "h2"),
            (3, "h5"),  # the seq FailingOnce refused was never handed out
        ]
        assert [(e.code, e.related_event_id) for e in heard] == [
            ("input_backpressure", "big"),
            ("input_backpressure", "a4"),
        ]
    finally:
        await parts.close()


# ------------------------------------------------------------ moves


async def test_a_resume_routes_to_the_owner_the_hash_names(parts):
    """A session moved (drain or failover) while no socket held it: the resume reads the
    hash's worker and owner generation, and its touch goes to the new worker."""
    await active_session(parts.store, "duplex-r", token="tok")
    assert await parts.store.move_owner("duplex-r", "worker-a", "worker-b", "drain") == 2
    attachment, _ = await resumed(parts, "duplex-r", "tok")
    assert (attachment.worker_id, attachment.owner_generation) == ("worker-b", 2)
    await attachment.touch()
    assert await inbox(parts.client, "worker-a") == []
    [touch] = await inbox(parts.client, "worker-b")
    assert touch == TouchRequest("duplex-r", 2)


async def test_a_move_routes_commands_when_its_owner_generation_is_newer(parts):
    await active_session(parts.store, "duplex-r", token="tok")
    attachment, _ = await resumed(parts, "duplex-r", "tok")
    assert (attachment.worker_id, attachment.owner_generation) == ("worker-a", 1)
    assert attachment.moved(1, "worker-c") is False  # the owner it already routes by
    assert attachment.moved(3, "worker-b") is True
    assert attachment.moved(2, "worker-c") is False  # a late notice of an older move
    assert attachment.moved(4, "") is False
    assert (attachment.worker_id, attachment.owner_generation) == ("worker-b", 3)
    assert await attachment.reread_owner() is False  # the hash is older (generation 1)
    assert attachment.worker_id == "worker-b"
    await attachment.release()
    assert attachment.moved(5, "worker-d") is False  # nothing held


# ------------------------------------------------------------ release


async def test_release_detaches_a_resumable_session_through_lease_detach(parts):
    await active_session(parts.store, "duplex-r", token="tok")
    attachment, _ = await resumed(parts, "duplex-r", "tok")
    await attachment.release()
    assert attachment.state is S.RELEASED
    meta = await parts.store.meta("duplex-r")
    assert (meta["state"], meta["detached_by"], meta["attachment_generation"]) == (
        "detached",
        "client",
        "2",
    )
    deadline = int(meta["lease_deadline"])
    assert deadline == int(meta["detached_at"]) + 30_000
    assert await parts.client.zscore(KEYS.leases(), "duplex-r") == deadline
    assert await api_sessions(parts) == set() and parts.liveness.attached == {}
    assert not parts.hub.listening(KEYS.live("duplex-r"))
    assert await inbox(parts.client, "worker-a") == []  # a detach writes no close


async def test_release_by_a_superseded_attachment_is_fenced_off(parts):
    await active_session(parts.store, "duplex-r", token="tok")
    old, token = await resumed(parts, "duplex-r", "tok")
    new, _ = await resumed(parts, "duplex-r", token)
    await old.release()  # its pump never saw the takeover: lease_detach refuses generation 2
    meta = await parts.store.meta("duplex-r")
    assert (meta["state"], meta["attachment_generation"]) == ("active", "3")
    assert await parts.client.zscore(KEYS.leases(), "duplex-r") is None
    assert parts.liveness.attached == {"duplex-r": 3}  # the new one's hold is kept
    assert new.state is S.ATTACHED


async def test_release_closes_a_session_whose_created_never_reached_its_client(parts):
    attachment = await opened(parts)
    sid = attachment.session_id
    await attachment.release()
    assert attachment.state is S.RELEASED
    close = (await inbox(parts.client, "w1"))[-1]
    assert close == CloseRequest(sid, "session_created_undelivered", 1)


async def test_release_closes_a_session_that_cannot_resume(parts):
    attachment = await opened(parts, resumable=False)
    attachment.created_delivered()
    assert attachment.state is S.ATTACHED
    await attachment.release()
    close = (await inbox(parts.client, "w1"))[-1]
    assert isinstance(close, CloseRequest) and close.reason == "disconnect"
    assert (await parts.store.meta(attachment.session_id))["state"] == "opening"  # no detach


@pytest.mark.parametrize("ending", ["end", "takeover"])
async def test_release_of_an_ended_or_replaced_session_writes_nothing(parts, ending):
    attachment = await opened(parts)
    attachment.created_delivered()
    if ending == "end":
        attachment.end()
        attachment.end()  # a second closure changes nothing
        assert attachment.state is S.ENDED
    else:
        assert attachment.taken_over(2) and attachment.state is S.REPLACED
    assert attachment.live is False
    await attachment.release()
    assert attachment.state is S.RELEASED
    assert [type(e) for e in await inbox(parts.client, "w1")] == [OpenRequest]
    assert await api_sessions(parts) == set()
    attachment.created_delivered()  # a late write of the writer changes nothing either
    assert attachment.state is S.RELEASED


async def test_a_socket_gone_while_a_worker_considers_the_open_closes_it_there(parts):
    """Cancelled mid-open (the pod shuts down): the worker asked is told to close the
    session its client never heard of."""
    asked = asyncio.Event()

    def silent(worker, sid, session):
        asked.set()
        return None

    parts.workers.answer = silent
    await register_worker(parts.client, "w1")
    attachment = parts.attachment(LiveFeed())
    opening = asyncio.create_task(attachment.open({}, None))
    await asked.wait()
    assert attachment.state is S.OPENING
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    sid = attachment.session_id
    await attachment.release()
    assert attachment.state is S.RELEASED
    open_entry, close = await inbox(parts.client, "w1")
    assert isinstance(open_entry, OpenRequest) and isinstance(close, CloseRequest)
    assert (close.session_id, close.reason) == (sid, "session_created_undelivered")
    assert await api_sessions(parts) == set() and not parts.hub.listening(KEYS.live(sid))
