"""The cluster client duplex-serve builds (shared/redis/connection.py): it keeps the nodes
it can start from when redis-py would forget them, and gives blocking readers clients of
their own."""

from __future__ import annotations

from redis.asyncio.cluster import RedisCluster

from shared.redis.connection import StartupNodes, cluster_client, connect


def test_a_failure_keeps_a_startup_node_and_a_topology_read_removes_it():
    nodes = StartupNodes({"a:1": "A", "b:2": "B", "c:3": "C"})
    # redis-py's failure path: pop(name, None); every node of a cascade failing in turn
    for name in ("a:1", "b:2", "c:3", "a:1"):
        assert nodes.pop(name, None) is None
    assert list(nodes) == ["a:1", "b:2", "c:3"]  # none forgotten, nothing moved
    assert nodes.pop("zz:9", None) is None and "zz:9" not in nodes
    # a topology read that no longer lists a node: pop(name), without a default
    assert nodes.pop("b:2") == "B"
    assert list(nodes) == ["a:1", "c:3"]


async def test_blocking_readers_get_cluster_clients_of_their_own(redis_cluster, redis_server):
    handle = connect(redis_cluster.url)
    try:
        await handle.client.initialize()
        reader = handle.reader_client()
        assert isinstance(reader, RedisCluster) and reader is not handle.client
        assert isinstance(reader.nodes_manager.startup_nodes, StartupNodes)
        # it starts from every node the handle knows, not only the URL's
        known = {node.name for node in handle.client.get_nodes()}
        assert known <= set(reader.nodes_manager.startup_nodes)
        await reader.set("reader-own", "1")
        assert await handle.client.get("reader-own") == b"1"
    finally:
        await handle.close()  # closes the reader's client too
    single = connect(redis_server.url)
    try:
        assert single.reader_client() is single.client  # one Redis: its pool serves both
    finally:
        await single.close()


def test_the_url_cluster_client_keeps_its_nodes_too():
    client = cluster_client("redis://127.0.0.1:1", [("127.0.0.1", 2)])
    assert isinstance(client.nodes_manager.startup_nodes, StartupNodes)
    assert set(client.nodes_manager.startup_nodes) == {"127.0.0.1:1", "127.0.0.1:2"}
