"""The worker process over an embedded Redis: registry, inbox dispatch, redelivery."""

import asyncio

import orjson

from services.worker.process import WorkerProcess
from shared.protocol.duplex import CloseSession, Heartbeat
from shared.redis.boundary import CommandRecord, InboxMessage, OpenRequest
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from shared.redis.live_message import split
from shared.redis.store import SessionStore
from shared.settings import WorkerSettings


async def test_registers_dispatches_once_and_deregisters():
    handle = connect(None)
    settings = WorkerSettings(worker_id="w1", max_sessions=2, heartbeat_interval_s=0.05)
    worker = WorkerProcess(settings, handle)
    keys = KeySchema()
    client = handle.client
    await worker.start()
    try:
        info = await client.hgetall(keys.worker("w1"))
        assert info[b"model"] == b"echo" and info[b"max_sessions"] == b"2"
        assert orjson.loads(info[b"capabilities"])["supports_session_resume"] is True
        assert await client.zscore(keys.workers(), "w1") is not None

        store = SessionStore(client, keys)
        await store.open("duplex-s1", "w1", "echo", "", "{}")
        pubsub = handle.new_client().pubsub()
        await pubsub.subscribe(keys.live("duplex-s1"))
        await worker.dispatch(OpenRequest("duplex-s1", {}))
        heartbeat = CommandRecord("duplex-s1", 1, 1, Heartbeat(event_id="h1"))
        await worker.dispatch(heartbeat)
        await worker.dispatch(heartbeat)  # a redelivery of the same (attachment, seq)
        await worker.dispatch(
            CommandRecord("duplex-s1", 2, 1, Heartbeat(event_id="h2"))
        )  # a newer attachment
        await worker.dispatch(
            CommandRecord("duplex-s1", 2, 2, CloseSession())
        )  # after the queued ones
        received = []
        while not received or received[-1]["type"] != "session.closed":
            message = await pubsub.get_message(timeout=2)
            if message and message["type"] == "message":  # one publisher round's events
                received += [orjson.loads(r.data) for r in split(message["data"])]
        kinds = [m["type"] for m in received]
        assert kinds == [
            "session.created",
            "session.updated",  # follows the first session.created (vLLM-Omni 0.30.0)
            "session.heartbeat_ack",
            "session.heartbeat_ack",
            "session.closed",
        ]
        assert [m.get("server_event_seq") for m in received] == [None, 1, 2, 3, 4]
        assert (await store.meta("duplex-s1"))["state"] == "closed"
        await pubsub.aclose()
        await worker.publisher.flush()  # its session.closed is in Redis: nothing of it stays
        assert "duplex-s1" not in worker.table
    finally:
        await worker.stop()
    assert await client.zscore(keys.workers(), "w1") is None
    assert await client.exists(keys.worker("w1")) == 0


async def test_a_refused_open_is_published_as_an_error():
    handle = connect(None)
    worker = WorkerProcess(WorkerSettings(worker_id="w2", max_sessions=1), handle)
    keys = KeySchema()
    await worker.start()
    try:
        store = SessionStore(handle.client, keys)
        pubsub = handle.new_client().pubsub()
        for sid in ("duplex-a", "duplex-b"):
            await store.open(sid, "w2", "echo", "", "{}")
            await pubsub.subscribe(keys.live(sid))
            await worker.dispatch(OpenRequest(sid, {}))
        replies = {}
        while len(replies) < 2:
            message = await pubsub.get_message(timeout=2)
            # an open's answer is a bare event (a framed round of journaled ones follows it)
            if message and message["type"] == "message" and message["data"][:1] == b"{":
                replies[message["channel"].decode()] = orjson.loads(message["data"])
        refused = replies[keys.live("duplex-b")]
        assert refused["type"] == "error" and refused["error"]["code"] == "resource_exhausted"
        assert refused["error"]["retryable"] is True
        # a configuration the worker refuses names its field, as the API pod's refusals do
        await worker.manager.close("duplex-a", "client_close")
        await store.open("duplex-c", "w2", "echo", "", "{}")
        await pubsub.subscribe(keys.live("duplex-c"))
        session = {"turn_detection": {"type": "bogus"}}
        await worker.dispatch(OpenRequest("duplex-c", session))
        refused = None
        while refused is None:
            message = await pubsub.get_message(timeout=2)
            if (
                message
                and message["type"] == "message"
                and message["channel"].decode() == (keys.live("duplex-c"))
            ):
                refused = orjson.loads(message["data"])
        assert refused["error"]["code"] == "unsupported_turn_detection"
        assert refused["error"]["param"] == "turn_detection"
        await pubsub.aclose()
    finally:
        await worker.stop()
    await asyncio.sleep(0)


async def test_health_endpoints_follow_the_worker():
    import httpx

    from harness.redis_server import free_port

    port = free_port()
    handle = connect(None)
    worker = WorkerProcess(WorkerSettings(worker_id="w3", health_port=port), handle)
    await worker.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/health")).json() == {"status": "ok"}
            ready = await http.get("/health/ready")
            assert ready.status_code == 200 and ready.json()["ready"] is True
            assert (await http.get("/nope")).status_code == 404
            worker._last_beat_ok = False  # as after a failed heartbeat
            assert (await http.get("/health/ready")).status_code == 503
    finally:
        await worker.stop()


async def test_handled_inbox_entries_leave_redis_with_their_audio():
    """The worker deletes what it handled: an append's audio does not stay in the inbox
    (issue 14: XACK alone kept every append until MAXLEN, 200 MiB from one session)."""
    from services.api.inbox_writer import InboxWriter
    from shared.protocol.duplex import AppendAudio

    handle = connect(None)
    worker = WorkerProcess(WorkerSettings(worker_id="w4", max_sessions=1), handle)
    keys = KeySchema()
    client = handle.client
    await worker.start()
    writer = InboxWriter(client, keys)
    try:
        store = SessionStore(client, keys)
        await store.open("duplex-s4", "w4", "echo", "", "{}")
        await writer.send("w4", OpenRequest("duplex-s4", {}))
        for seq in range(1, 21):  # each awaited: an entry each
            append = AppendAudio(audio=b"\x00\x01" * 8000, event_id=f"a{seq}")
            await writer.send("w4", CommandRecord("duplex-s4", 1, seq, append))
        for _ in range(400):  # until the worker has handled and deleted all 21 entries
            if await client.xlen(keys.inbox("w4")) == 0:
                break
            await asyncio.sleep(0.01)
        assert await client.xlen(keys.inbox("w4")) == 0
        assert int(await client.get(keys.inbox_bytes("w4"))) == 0
        assert (await client.xpending(keys.inbox("w4"), "runners"))["pending"] == 0
    finally:
        await writer.stop()
        await worker.stop()
    assert await client.exists(keys.inbox("w4"), keys.inbox_bytes("w4")) == 0


async def test_a_restarted_worker_dispatches_its_pending_entries_once():
    """After a crash, the worker first reads its own pending entries ("0"). Until the ack
    loop's XACK lands they stay pending: reading from "0" again returned them again, and an
    open or a close (not deduplicated by seq) ran twice."""
    import asyncio

    from shared.redis.boundary import CloseRequest
    from shared.redis.keys import INBOX_GROUP

    handle = connect(None)
    keys = KeySchema()
    client = handle.client
    inbox = keys.inbox("w5")
    await client.xgroup_create(inbox, INBOX_GROUP, id="0", mkstream=True)
    for sid in ("duplex-p1", "duplex-p2"):
        await client.xadd(inbox, CloseRequest(sid, "client_close").to_fields())
    # the crashed process had read both (pending for consumer w5) and acked neither
    await client.xreadgroup(INBOX_GROUP, "w5", {inbox: ">"}, count=10)
    worker = WorkerProcess(WorkerSettings(worker_id="w5"), handle)
    dispatched: list[str] = []
    both = asyncio.Event()

    async def record(message: InboxMessage) -> None:
        dispatched.append(message.session_id)
        if len(dispatched) >= 2:
            both.set()

    worker.dispatch = record
    # the consume loop alone, no ack loop: the XACK has not landed yet
    reading = asyncio.create_task(worker.reader.consume())
    try:
        async with asyncio.timeout(10):
            await both.wait()
            while worker.reader.read_from != ">":  # until the pending phase is over
                await asyncio.sleep(0.01)
    finally:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
    assert dispatched == ["duplex-p1", "duplex-p2"]


async def test_the_slot_is_free_where_placement_reads_it_before_session_closed():
    """vLLM-Omni 0.30.0: a client that sees session.closed can open a replacement at once.
    Placement reads the worker's `active`: it is written before the event is published
    (heartbeats are far apart here, so none writes it in between)."""
    handle = connect(None)
    settings = WorkerSettings(worker_id="w3", max_sessions=1, heartbeat_interval_s=3600)
    worker = WorkerProcess(settings, handle)
    keys = KeySchema()
    client = handle.client
    await worker.start()
    try:
        store = SessionStore(client, keys)
        await store.open("duplex-a", "w3", "echo", "", "{}")
        pubsub = handle.new_client().pubsub()
        await pubsub.subscribe(keys.live("duplex-a"))
        await worker.dispatch(OpenRequest("duplex-a", {}))
        assert await client.hget(keys.worker("w3"), "active") == b"1"
        # the client's session.close, as the API pod forwards it: closed by the runner
        await worker.dispatch(CommandRecord("duplex-a", 1, 1, CloseSession()))
        seen: list[str] = []
        while "session.closed" not in seen:
            message = await pubsub.get_message(timeout=2)
            if message and message["type"] == "message" and message["data"][:1] != b"{":
                seen += [orjson.loads(r.data)["type"] for r in split(message["data"])]
        assert await client.hget(keys.worker("w3"), "active") == b"0"
        await pubsub.aclose()
    finally:
        await worker.stop()
