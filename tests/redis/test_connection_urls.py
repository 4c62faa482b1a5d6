"""`DUPLEX_REDIS_URL`'s forms, parsed without a server: a Sentinel set's URL (its sentinels,
service, database, the data nodes' and the sentinels' credentials, TLS), what is refused
with a clear error, and what the logs may print of it (never a password)."""

from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster

from shared.redis.connection import (
    CONNECT_TIMEOUT_S,
    SENTINEL_PORT,
    connect,
    parse_sentinel_url,
    redact,
)


def test_a_sentinel_url_names_its_sentinels_service_and_database():
    target = parse_sentinel_url(
        "redis+sentinel://app:s%40cret@10.0.0.1:26380,[fd00::2]:26381,sentinel-3/duplex/2"
        "?sentinel_username=watch&sentinel_password=pw"
    )
    assert target.sentinels == (
        ("10.0.0.1", 26380),
        ("fd00::2", 26381),
        ("sentinel-3", SENTINEL_PORT),
    )
    assert target.service == "duplex"
    # the userinfo is the data nodes' (unquoted), the sentinel_ options the sentinels' own
    assert (target.connection["username"], target.connection["password"]) == ("app", "s@cret")
    assert target.connection["db"] == 2
    assert target.sentinel_options["username"] == "watch"
    assert target.sentinel_options["password"] == "pw"
    # both kinds of link connect with a timeout and keepalive
    for options in (target.connection, target.sentinel_options):
        assert options["socket_connect_timeout"] == CONNECT_TIMEOUT_S
        assert options["socket_keepalive"] is True
    assert "ssl" not in target.connection
    assert target.describe() == "Redis via Sentinel 'duplex' @ 10.0.0.1:26380,+2"


def test_tls_reaches_the_data_nodes_and_the_sentinels():
    target = parse_sentinel_url("rediss+sentinel://h1:26379/duplex")
    assert target.connection["ssl"] is True and target.sentinel_options["ssl"] is True
    assert "db" not in target.connection  # redis-py's default, 0


@pytest.mark.parametrize(
    "url, said",
    [
        ("redis+sentinel://h1:26379", "/<service>"),
        ("redis+sentinel://h1:26379/", "/<service>"),
        ("redis+sentinel://h1:26379/duplex/zero", "must be a number"),
        ("redis+sentinel://h1:26379/duplex/0/extra", "/<service>"),
        ("redis+sentinel:///duplex", "at least one sentinel"),
        ("redis+sentinel://h1:port/duplex", "not a port"),
        ("redis+sentinel://h1/duplex?sentinel_pasword=x", "unknown option 'sentinel_pasword'"),
    ],
)
def test_a_bad_sentinel_url_is_refused_with_what_is_wrong(url, said):
    with pytest.raises(ValueError, match=said.replace("(", r"\(")):
        parse_sentinel_url(url)


def test_a_refusal_never_prints_the_password():
    with pytest.raises(ValueError) as refused:
        parse_sentinel_url("redis+sentinel://app:hunter2@h1/duplex?sentinel_password=hunter3&x=1")
    assert "hunter2" not in str(refused.value) and "hunter3" not in str(refused.value)


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://:pw@h:6379/0", "redis://***@h:6379/0"),
        ("redis+sentinel://u:pw@h1,h2/duplex?sentinel_password=pw2&sentinel_username=w",
         "redis+sentinel://***@h1,h2/duplex?sentinel_password=***&sentinel_username=w"),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_redact_hides_every_password(url, shown):
    assert redact(url) == shown


async def test_connect_makes_a_client_that_asks_the_sentinels_for_the_primary():
    handle = connect("redis+sentinel://127.0.0.1:1,127.0.0.1:2/duplex/3")
    try:
        assert handle.sentinel is not None and handle.sentinel.service == "duplex"
        assert not handle.cluster and handle.server is None
        pool = handle.client.connection_pool
        assert pool.service_name == "duplex"
        assert pool.connection_kwargs["db"] == 3
        assert pool.connection_kwargs["socket_connect_timeout"] == CONNECT_TIMEOUT_S
        assert "Sentinel 'duplex'" in handle.description
    finally:
        await handle.close()


async def test_every_real_client_connects_with_a_timeout_and_keepalive():
    single = connect("redis://127.0.0.1:1/0")
    cluster = connect("redis+cluster://127.0.0.1:1")
    try:
        kwargs = single.client.connection_pool.connection_kwargs
        assert kwargs["socket_connect_timeout"] == CONNECT_TIMEOUT_S
        assert kwargs["socket_keepalive"] is True
        assert isinstance(cluster.client, RedisCluster)
        node_kwargs = cluster.client.connection_kwargs
        assert node_kwargs["socket_connect_timeout"] == CONNECT_TIMEOUT_S
        assert node_kwargs["socket_keepalive"] is True
    finally:
        await single.close()
        await cluster.close()
