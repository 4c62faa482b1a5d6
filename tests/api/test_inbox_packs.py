"""Issue 18, the API side: many sessions' commands to one worker travel together, one entry per
writer round, in order, with contiguous seqs; the budget still refuses (and gives the seqs
back); appends do not hold the socket's reader, and their failures reach the client."""

import asyncio
import collections
import logging

import fakeredis
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from services.api.command_sender import CommandSender
from services.api.inbox_writer import CommandSeq, InboxFull, InboxWriter
from services.api.worker_client import WorkerClient
from shared.protocol.duplex import AppendAudio, Commit, Heartbeat
from shared.redis.boundary import CommandRecord, decode_entry, entry_bytes
from shared.redis.keys import KeySchema

KEYS = KeySchema()


def append(n: int, size: int = 640) -> AppendAudio:
    return AppendAudio(audio=bytes([n % 256]) * size, event_id=f"a{n}")


async def commands_in(client, worker: str) -> list[tuple[str, int, str]]:
    """(session, seq, command type + event id) of every command in the inbox, in order."""
    out = []
    for _, fields in await client.xrange(KEYS.inbox(worker)):
        for record in decode_entry(fields):
            assert isinstance(record, CommandRecord)
            out.append((record.session_id, record.seq, record.command.event_id))
    return out


async def test_interleaved_sessions_share_entries_and_keep_their_order(redis_client):
    writer = InboxWriter(redis_client, KEYS, linger_s=0.01)
    workers = WorkerClient(writer)
    seqs = {f"duplex-{i}": CommandSeq() for i in range(8)}

    async def session(sid: str) -> None:
        pending = []
        for turn in range(3):
            for n in range(10):  # appends are queued, not awaited one by one
                event = append(turn * 100 + n)
                pending.append(workers.send_command("w", sid, 1, seqs[sid], event))
            await workers.command("w", sid, 1, seqs[sid], Commit(event_id=f"c{turn}"))
        await asyncio.gather(*pending)

    await asyncio.gather(*(session(sid) for sid in seqs))
    await writer.stop()
    entries = await redis_client.xrange(KEYS.inbox("w"))
    assert writer.commands == 8 * 33
    assert len(entries) == writer.entries < 8 * 33 / 4  # many commands in one entry
    assert any(len(decode_entry(fields)) > 1 for _, fields in entries)
    by_session = collections.defaultdict(list)
    for sid, seq, event_id in await commands_in(redis_client, "w"):
        by_session[sid].append((seq, event_id))
    for sid in seqs:
        expected = []
        for turn in range(3):
            expected += [f"a{turn * 100 + n}" for n in range(10)] + [f"c{turn}"]
        assert by_session[sid] == list(enumerate(expected, start=1))  # contiguous, in order
    # what the API counted is what the worker will give back, entry by entry
    counted = sum(entry_bytes(fields) for _, fields in entries)
    assert int(await redis_client.get(KEYS.inbox_bytes("w"))) == counted


async def test_linger_zero_sends_at_once_as_before(redis_client):
    writer = InboxWriter(redis_client, KEYS, linger_s=0)
    workers = WorkerClient(writer)
    seqs = CommandSeq()
    for n in range(3):  # each awaited: one entry each, a lone message in it
        await workers.command("w", "duplex-s", 1, seqs, append(n))
    await writer.stop()
    entries = await redis_client.xrange(KEYS.inbox("w"))
    assert [len(decode_entry(fields)) for _, fields in entries] == [1, 1, 1]
    assert await commands_in(redis_client, "w") == [("duplex-s", n + 1, f"a{n}") for n in range(3)]


async def test_a_lingering_append_leaves_with_the_next_command_at_once(redis_client):
    writer = InboxWriter(redis_client, KEYS, linger_s=60)  # never by the timer here
    workers = WorkerClient(writer)
    seqs = CommandSeq()
    queued = workers.send_command("w", "duplex-s", 1, seqs, append(1))
    async with asyncio.timeout(5):
        await workers.command("w", "duplex-s", 1, seqs, Heartbeat(event_id="h"))
    assert queued.done()
    await writer.stop()
    [(_, fields)] = await redis_client.xrange(KEYS.inbox("w"))
    assert len(decode_entry(fields)) == 2  # one entry
    assert await commands_in(redis_client, "w") == [("duplex-s", 1, "a1"), ("duplex-s", 2, "h")]


async def test_a_refused_entry_fails_every_budgeted_caller_and_gives_the_seqs_back(
    redis_client,
):
    first = CommandRecord("duplex-a", 1, 1, append(0, 1000))
    writer = InboxWriter(redis_client, KEYS, max_bytes=entry_bytes(first.to_fields()), linger_s=60)
    workers = WorkerClient(writer)
    await writer.send("w", first)  # not lingering: it leaves at once and fills the inbox
    seqs = {"duplex-a": CommandSeq(1), "duplex-b": CommandSeq()}
    a1 = workers.send_command("w", "duplex-a", 1, seqs["duplex-a"], append(1))
    b1 = workers.send_command("w", "duplex-b", 1, seqs["duplex-b"], append(2))
    heartbeat = workers.send_command("w", "duplex-b", 1, seqs["duplex-b"], Heartbeat(event_id="hb"))
    results = await asyncio.gather(a1, b1, heartbeat, return_exceptions=True)
    assert isinstance(results[0], InboxFull) and isinstance(results[1], InboxFull)
    assert results[2] is None  # a heartbeat passes a full inbox, in an entry of its own
    assert (seqs["duplex-a"].last, seqs["duplex-b"].last) == (1, 1)
    await writer.stop()
    assert await commands_in(redis_client, "w") == [("duplex-a", 1, "a0"), ("duplex-b", 1, "hb")]


async def test_an_append_failure_reaches_the_client_with_its_event_id(redis_client):
    first = CommandRecord("duplex-a", 1, 1, append(0, 2000)).to_fields()
    writer = InboxWriter(redis_client, KEYS, max_bytes=entry_bytes(first), linger_s=0.005)
    workers = WorkerClient(writer)
    sender = CommandSender(workers)
    heard = []
    sender.report = heard.append
    await workers.command("w", "duplex-a", 1, sender.seqs, append(0, 2000))  # fills it
    assert await sender.send("w", "duplex-a", 1, append(7)) is None  # queued only
    async with asyncio.timeout(5):
        while not heard:
            await asyncio.sleep(0.005)
    [event] = heard
    error = event.to_dict()["error"]
    assert (error["code"], error["event_id"], error["retryable"]) == (
        "input_backpressure",
        "a7",
        True,
    )
    assert sender.seqs.last == 1 and sender.unsent == 0
    await writer.stop()


async def test_a_reader_waits_only_past_its_bound_of_unsent_appends(redis_client, monkeypatch):
    import services.api.command_sender as command_sender

    monkeypatch.setattr(command_sender, "MAX_UNSENT_APPENDS", 3)
    writer = InboxWriter(redis_client, KEYS, linger_s=60)
    sender = CommandSender(WorkerClient(writer))
    for n in range(3):
        await sender.send("w", "duplex-a", 1, append(n))
    assert sender.unsent == 3 and await redis_client.xlen(KEYS.inbox("w")) == 0
    fourth = asyncio.create_task(sender.send("w", "duplex-a", 1, append(3)))
    async with asyncio.timeout(5):  # until it is queued: past the bound, it waits there
        while sender.unsent < 4:
            await asyncio.sleep(0)
    # the reader waits for the oldest's write, which the 60 s linger holds back
    assert not fourth.done() and await redis_client.xlen(KEYS.inbox("w")) == 0
    flush = await sender.send("w", "duplex-a", 1, Heartbeat(event_id="h"))
    assert flush is not None
    await asyncio.wait_for(asyncio.gather(fourth, flush), 5)
    await writer.stop()


async def test_by_default_an_append_failure_goes_to_the_live_feed_as_a_bare_event(redis_client):
    """Until the connection hands it to its delivery directly, the pump sends it on."""
    import orjson

    from services.api.live import LiveFeed

    first = CommandRecord("duplex-a", 1, 1, append(0, 2000)).to_fields()
    writer = InboxWriter(redis_client, KEYS, max_bytes=entry_bytes(first), linger_s=0.005)
    workers = WorkerClient(writer)
    feed = LiveFeed()
    sender = CommandSender(workers, feed)
    await workers.command("w", "duplex-a", 1, sender.seqs, append(0, 2000))
    await sender.send("w", "duplex-a", 1, append(9))
    event = orjson.loads(await asyncio.wait_for(feed.get(), 5))
    assert event["type"] == "error" and "server_event_seq" not in event
    assert (event["error"]["code"], event["error"]["event_id"]) == ("input_backpressure", "a9")
    await writer.stop()


class CountingEvent(asyncio.Event):
    """The writer's `_urgent` event: each `wait()` is a linger, noted with the number of
    pipelines already sent when it began."""

    def __init__(self, writer: InboxWriter) -> None:
        super().__init__()
        self.writer = writer
        self.lingers: list[int] = []

    async def wait(self) -> bool:
        self.lingers.append(self.writer.pipelines)
        return await super().wait()


async def test_appends_left_by_a_round_cut_short_do_not_linger_again(redis_client, monkeypatch):
    """A round takes at most MAX_ITEMS: what it leaves has lingered since it was queued, so
    the next rounds leave as soon as the previous one is back (they waited a whole new
    linger each)."""
    import services.api.inbox_round as inbox_round

    monkeypatch.setattr(inbox_round, "MAX_ITEMS", 4)
    writer = InboxWriter(redis_client, KEYS, linger_s=0.5)
    writer._urgent = urgent = CountingEvent(writer)
    workers = WorkerClient(writer)
    seqs = CommandSeq()
    queued = [workers.send_command("w", "duplex-s", 1, seqs, append(n)) for n in range(10)]
    async with asyncio.timeout(10):
        await asyncio.gather(*queued)
    await writer.stop()
    assert writer.entries == await redis_client.xlen(KEYS.inbox("w")) == 3  # 4 + 4 + 2
    assert urgent.lingers == [0]  # one linger, before the first round only
    expected = [("duplex-s", n + 1, f"a{n}") for n in range(10)]
    assert await commands_in(redis_client, "w") == expected


class Flaky:
    """A client whose pipelines fail while `down` (Redis failing over), the real one else;
    `failure`: what they raise."""

    def __init__(self, client) -> None:
        self.client = client
        self.down = False
        self.failure: Exception = RedisConnectionError("Connection refused")

    def pipeline(self, transaction: bool = False):
        pipeline = self.client.pipeline(transaction=transaction)
        if self.down:

            async def fail(*args, **kwargs):
                raise self.failure

            pipeline.execute = fail
        return pipeline

    def __getattr__(self, name):
        return getattr(self.client, name)


async def test_the_pod_logs_an_outage_once_not_once_per_command(caplog):
    """Many sessions' commands failing for as long as a failover lasts: one WARNING when the
    writes begin to fail, one when they work again (with how long and how many), whatever
    the number of commands and sessions."""
    real = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    flaky = Flaky(real)
    writer = InboxWriter(flaky, KEYS, linger_s=0)
    workers = WorkerClient(writer)
    seqs = {sid: CommandSeq() for sid in ("duplex-a", "duplex-b", "duplex-c")}
    with caplog.at_level(logging.WARNING, logger="services.api.inbox_writer"):
        flaky.down = True
        failed = 0
        for n in range(30):
            sid = f"duplex-{'abc'[n % 3]}"
            try:
                await workers.command("w", sid, 1, seqs[sid], Heartbeat(event_id=f"h{n}"))
            except RedisConnectionError:
                failed += 1
        flaky.down = False
        await workers.command("w", "duplex-a", 1, seqs["duplex-a"], Heartbeat(event_id="back"))
    await writer.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert failed == 30
    assert len(lines) == 2, lines
    assert lines[0].startswith("writing clients' commands to the workers' inboxes failed")
    assert "works again" in lines[1] and "(30 tries failed)" in lines[1]


async def test_the_client_library_failing_mid_failover_is_a_store_error_not_a_bug():
    """redis-py 5.3.1's cluster pipeline raises AttributeError when another command's
    failure closed its nodes meanwhile: the callers hear their commands were not written
    (RedisError: a retryable internal_error), and their sockets live on."""
    real = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    flaky = Flaky(real)
    flaky.down = True
    flaky.failure = AttributeError("'NoneType' object has no attribute 'name'")
    writer = InboxWriter(flaky, KEYS, linger_s=0)
    workers = WorkerClient(writer)
    try:
        with pytest.raises(RedisConnectionError, match="the Redis client failed"):
            await workers.command("w", "duplex-a", 1, CommandSeq(), Heartbeat(event_id="h"))
    finally:
        await writer.stop()


class OneInboxDown:
    """A client whose pipeline's calls to one worker's inbox fail (its master is away), the
    others' going through: one Redis Cluster master of several lost."""

    def __init__(self, client, down: str) -> None:
        self.client = client
        self.down: str | None = down

    def pipeline(self, transaction: bool = False):
        real = self.client.pipeline(transaction=transaction)
        queued: list[tuple] = []
        execute_command, execute = real.execute_command, real.execute

        def remember(*args, **kwargs):
            queued.append(args)
            return execute_command(*args, **kwargs)

        async def results(raise_on_error: bool = True):
            replies = await execute(raise_on_error=raise_on_error)
            return [
                RedisConnectionError("Connection refused")
                if self.down is not None and any(f"{{{self.down}}}" in str(a) for a in args)
                else reply
                for args, reply in zip(queued, replies, strict=True)
            ]

        real.execute_command, real.execute = remember, results
        return real

    def __getattr__(self, name):
        return getattr(self.client, name)


async def test_an_inbox_that_stays_away_is_one_run_of_the_log_however_the_rounds_mix(caplog):
    """One worker's inbox fails round after round (its master is away) while another's is
    written in the rounds between: the log says it failed once and works again once, when
    the failing inbox is written again, not at every round that happened to miss it."""
    real = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    client = OneInboxDown(real, "w-dead")
    writer = InboxWriter(client, KEYS, linger_s=0)
    workers = WorkerClient(writer)
    seqs = {worker: CommandSeq() for worker in ("w-dead", "w-live")}
    failed = 0
    with caplog.at_level(logging.WARNING, logger="services.api.inbox_writer"):
        for n in range(20):
            worker = ("w-dead", "w-live")[n % 2]  # a round each: one fails, one is written
            try:
                await workers.command(
                    worker, "duplex-a", 1, seqs[worker], Heartbeat(event_id=f"h{n}")
                )
            except RedisConnectionError:
                failed += 1
        during = [r.getMessage() for r in caplog.records]
        client.down = None
        await workers.command("w-dead", "duplex-a", 1, seqs["w-dead"], Heartbeat(event_id="back"))
    await writer.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert failed == 10
    assert len(during) == 1 and "failed" in during[0], during
    assert len(lines) == 2 and "works again" in lines[1] and "(10 tries failed)" in lines[1], lines
