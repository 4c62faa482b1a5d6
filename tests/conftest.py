"""Fixtures shared by the whole suite."""

import pytest

from harness.redis_cluster import RedisClusterServers
from harness.redis_server import RedisServer
from harness.sessions import make_harness


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


@pytest.fixture(scope="session")
def redis_cluster():
    """One 3-master Redis Cluster for the whole run, on free loopback ports."""
    servers = RedisClusterServers()
    yield servers
    servers.stop()


@pytest.fixture(params=["redis-server", "redis-cluster", "fakeredis"])
async def redis_client(request):
    """The same tests against a real Redis, a Redis Cluster and fakeredis, flushed per test."""
    if request.param == "redis-server":
        import redis.asyncio as redis_async

        client = redis_async.Redis.from_url(request.getfixturevalue("redis_server").url)
        await client.flushdb()
    elif request.param == "redis-cluster":
        from shared.redis.connection import connect

        handle = connect(request.getfixturevalue("redis_cluster").url)
        client = handle.client
        await client.flushdb(target_nodes="primaries")
        # the cluster client itself: tests listen with tests/redis/sharded_listener.py
        client.pubsub_client = handle.pubsub_client
    else:
        import fakeredis

        client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    yield client
    await client.aclose()
