"""The API pod's shared XADD pipelines: batched under load, ordered, errors to their callers."""

import asyncio

import pytest
from redis.exceptions import RedisError, ResponseError

from services.api.inbox_writer import InboxWriter


async def test_concurrent_commands_share_pipelines_and_keep_their_order(redis_client):
    writer = InboxWriter(redis_client)
    streams = [f"{{inbox-{i}}}:s" for i in range(4)]

    async def connection(stream: str) -> None:
        for n in range(50):  # like a connection: each command awaited before the next
            await writer.xadd(stream, {"n": str(n)})

    await asyncio.gather(*(connection(s) for s in streams))
    await writer.stop()
    assert writer.commands == 200
    assert writer.pipelines < 200  # four connections' commands travelled together
    for stream in streams:
        entries = await redis_client.xrange(stream)
        assert [int(f[b"n"]) for _, f in entries] == list(range(50))


async def test_a_failing_command_fails_only_its_caller(redis_client):
    writer = InboxWriter(redis_client)
    await redis_client.set("{inbox-x}:not-a-stream", "x")
    results = await asyncio.gather(
        writer.xadd("{inbox-x}:not-a-stream", {"n": "1"}),
        writer.xadd("{inbox-x}:stream", {"n": "2"}),
        return_exceptions=True,
    )
    await writer.stop()
    assert isinstance(results[0], ResponseError) and results[1] is None
    assert len(await redis_client.xrange("{inbox-x}:stream")) == 1


async def test_redis_unreachable_reaches_every_caller_and_the_writer_goes_on():
    import redis.asyncio as redis_async

    from tests.redis_server import free_port

    dead = redis_async.Redis(port=free_port(), socket_connect_timeout=0.5)
    writer = InboxWriter(dead)
    results = await asyncio.gather(
        *(writer.xadd("s", {"n": str(n)}) for n in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, RedisError) for r in results), results
    with pytest.raises(RedisError):  # the writer task survived and serves the next one
        await writer.xadd("s", {"n": "4"})
    await writer.stop()
    await dead.aclose()
