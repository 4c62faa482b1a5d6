"""Fixtures shared by the whole suite."""

import pytest

from tests.redis_server import RedisServer
from tests.sessions import make_harness


@pytest.fixture
async def harness():
    """A SessionManager with the echo model (max 4 sessions) and an inline client."""
    h = make_harness()
    yield h
    await h.manager.shutdown()


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the whole run, on a free port."""
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(params=["redis-server", "fakeredis"])
async def redis_client(request):
    """The same tests against a real Redis and the embedded fakeredis, flushed per test."""
    if request.param == "redis-server":
        import redis.asyncio as redis_async

        client = redis_async.Redis.from_url(request.getfixturevalue("redis_server").url)
        await client.flushdb()
    else:
        import fakeredis

        client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()
