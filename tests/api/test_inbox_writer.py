"""The API pod's inbox pipelines: batched under load, ordered, budgeted, errors to their callers.

Every message goes the way production sends it: `InboxWriter.send(worker, message,
budgeted=...)`; a round gives each worker one entry (`encode_entry`)."""

import asyncio

import pytest
from redis.exceptions import RedisError, ResponseError

from services.api.inbox_writer import InboxFull, InboxWriter
from shared.protocol.duplex import AppendAudio, Heartbeat
from shared.redis.boundary import (
    MIN_ENTRY_BYTES,
    CloseRequest,
    CommandRecord,
    InboxMessage,
    decode_entry,
    entry_bytes,
)
from shared.redis.keys import KeySchema

KEYS = KeySchema()


def heartbeat(n: int, session: str = "duplex-s") -> InboxMessage:
    return CommandRecord(session, 1, n, Heartbeat(event_id=f"h{n}"))


def close(session: str = "duplex-s") -> InboxMessage:
    return CloseRequest(session, "client_close")


async def messages_in(client, worker: str) -> list[InboxMessage]:
    return [
        m for _, fields in await client.xrange(KEYS.inbox(worker)) for m in decode_entry(fields)
    ]


async def test_concurrent_commands_share_pipelines_and_keep_their_order(redis_client):
    writer = InboxWriter(redis_client)
    workers = [f"w{i}" for i in range(4)]

    async def connection(worker: str) -> None:
        for n in range(50):  # like a connection: each command awaited before the next
            await writer.send(worker, heartbeat(n))

    await asyncio.gather(*(connection(w) for w in workers))
    await writer.stop()
    assert writer.commands == 200
    assert writer.pipelines < 200  # four connections' commands travelled together
    for worker in workers:
        assert await messages_in(redis_client, worker) == [heartbeat(n) for n in range(50)]


async def test_the_budget_counts_payload_and_audio_and_refuses_past_it(redis_client):
    audio = AppendAudio(audio=b"\x00" * 1000, event_id="a")
    message = CommandRecord("duplex-s", 1, 1, audio)
    fields = message.to_fields()
    size = entry_bytes(fields)
    assert size == len(fields["m"]) + 1000 > MIN_ENTRY_BYTES
    writer = InboxWriter(redis_client, max_bytes=3 * size)
    for _ in range(3):
        await writer.send("w", message)
    with pytest.raises(InboxFull):
        await writer.send("w", message)
    await writer.send("w", close(), budgeted=False)  # closes always pass
    await writer.stop()
    kinds = [type(m) for m in await messages_in(redis_client, "w")]
    assert kinds == [CommandRecord] * 3 + [CloseRequest]  # the refused one was never written
    # the close costs the least an entry costs
    assert entry_bytes(close().to_fields()) == MIN_ENTRY_BYTES
    assert int(await redis_client.get(KEYS.inbox_bytes("w"))) == 3 * size + MIN_ENTRY_BYTES


async def test_the_inbox_is_bounded_in_entries_too_and_never_trimmed(redis_client):
    # tiny entries cost MIN_ENTRY_BYTES each: the byte budget bounds their count
    assert entry_bytes(heartbeat(1).to_fields()) == MIN_ENTRY_BYTES
    writer = InboxWriter(redis_client, max_bytes=3 * MIN_ENTRY_BYTES)
    for n in range(3):
        await writer.send("w", heartbeat(n))
    with pytest.raises(InboxFull):
        await writer.send("w", heartbeat(3))
    await writer.send("w", close(), budgeted=False)
    await writer.stop()
    expected = [heartbeat(n) for n in range(3)] + [close()]
    assert await messages_in(redis_client, "w") == expected  # nothing dropped


async def test_a_failing_command_fails_only_its_caller(redis_client):
    writer = InboxWriter(redis_client)
    await redis_client.set(KEYS.inbox("x"), "not a stream")
    results = await asyncio.gather(
        writer.send("x", heartbeat(1)),
        writer.send("y", heartbeat(2)),
        return_exceptions=True,
    )
    await writer.stop()
    assert isinstance(results[0], ResponseError) and results[1] is None
    assert await messages_in(redis_client, "y") == [heartbeat(2)]


async def test_scripts_lost_by_a_restarted_redis_are_loaded_again(redis_server):
    import redis.asyncio as redis_async

    client = redis_async.Redis.from_url(redis_server.url)
    await client.delete(KEYS.inbox("w"), KEYS.inbox_bytes("w"))
    writer = InboxWriter(client)
    await writer.send("w", heartbeat(1))
    await client.script_flush()  # what a restarted Redis has: no scripts
    await writer.send("w", heartbeat(2))
    await writer.stop()
    assert await messages_in(client, "w") == [heartbeat(1), heartbeat(2)]
    await client.aclose()


async def test_redis_unreachable_reaches_every_caller_and_the_writer_goes_on():
    import redis.asyncio as redis_async

    from harness.redis_server import free_port

    dead = redis_async.Redis(port=free_port(), socket_connect_timeout=0.5)
    writer = InboxWriter(dead)
    results = await asyncio.gather(
        *(writer.send("w", heartbeat(n)) for n in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, RedisError) for r in results), results
    with pytest.raises(RedisError):  # the writer task survived and serves the next one
        await writer.send("w", heartbeat(4))
    await writer.stop()
    await dead.aclose()
