"""Fixtures of the Redis tests: Redis Sentinel sets (harness/redis_sentinel.py)."""

import pytest

from harness.redis_sentinel import RedisSentinelSet


@pytest.fixture(scope="session")
def redis_sentinel():
    """One Sentinel set (a primary, its replica, three sentinels) for the whole run, for
    the tests that leave its primary alive."""
    sentinels = RedisSentinelSet()
    yield sentinels
    sentinels.stop()


@pytest.fixture
def sentinel_set():
    """A Sentinel set of the test's own, for a test that kills its primary: after the
    failover the set has a primary and no live replica, which no other test expects."""
    sentinels = RedisSentinelSet()
    yield sentinels
    sentinels.stop()
