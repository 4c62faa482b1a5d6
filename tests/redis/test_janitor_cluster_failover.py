"""The API pod's janitor on a Redis Cluster whose master serving arq's queue fails over.

arq knows nothing of clusters: its keys share one hash tag and it talks to the one node that
serves that tag's slot. Each restart of arq's run after a failure asks the cluster again which
node that is, so the janitor follows the replica promoted in the dead master's place. Before,
the restarts reused a client pinned to the dead master's address: no sweep ran on any pod
until the pods were restarted (a detached session was never expired, a dead worker's
sessions never moved).

The cluster is the test's own: its tag's master is killed and stays dead. Its replica is
promoted only after the janitor's restarts have failed a few times against the dead master's
address (the cluster names it until a replica takes over: a node timeout, in production)."""

import pytest

from harness.redis_cluster import RedisClusterServers
from shared.redis.connection import connect
from shared.redis.keys import KeySchema
from shared.redis.slot_map import slot_of
from tests.api.parts import janitor_on
from tests.redis.cluster_ops import add_replica, eventually, kill, node, slot_owner, take_over
from tests.redis.test_sentinel import lease_expires

KEYS = KeySchema()
#: the hash tag the janitor gives arq's keys on a cluster (services/api/janitor.py)
ARQ_TAG = "{" + KEYS.arq_queue() + "}"
#: generous: a loaded 2-core machine stretches the cluster's and arq's seconds
RECOVERY_TIMEOUT_S = 60.0


@pytest.fixture
def servers():
    servers = RedisClusterServers()
    yield servers
    servers.stop()


async def normal_clients(port: int) -> int:
    """How many client connections (replication links and the cluster bus aside) the node
    at `port` holds, the one asking included."""
    client = node(port)
    try:
        return len(await client.client_list(_type="normal"))
    finally:
        await client.aclose()


async def test_the_janitor_sweeps_again_after_its_queue_master_fails_over(servers):
    owner = await slot_owner(servers, slot_of(ARQ_TAG))
    replica = await add_replica(servers, owner)
    # the pod's seed is another master: the test is about arq's client, not about the pod's
    # cluster client losing the node it was given
    seed = next(port for port in servers.ports if port != owner)
    handle = connect(f"redis+cluster://127.0.0.1:{seed}")
    janitor, workers = janitor_on(handle)
    await janitor.start()
    try:
        await lease_expires(janitor, "duplex-before", "w-before")
        kill(servers, owner)

        async def restarts_failed() -> bool:
            assert janitor._loop is not None
            return janitor._loop.failures >= 3

        # until a replica is promoted (here: by hand, later), the cluster still names the dead
        # master: the restarts fail, and are tried again after a pause
        await eventually(restarts_failed, RECOVERY_TIMEOUT_S, "arq's run to fail and restart")
        await take_over(replica)

        async def promoted() -> bool:
            return await slot_owner(servers, slot_of(ARQ_TAG)) == replica

        await eventually(promoted, what="the replica to own arq's slot")
        # a lease that expires after the failover is swept: arq's cron runs again, on the
        # promoted replica
        await lease_expires(janitor, "duplex-after", "w-after")
    finally:
        await janitor.stop()
        await workers.stop()
        await handle.close()

    async def only_ours_left() -> bool:
        return await normal_clients(replica) == 1

    # stop() closed arq's client on the promoted master (the pod's client is closed too)
    await eventually(only_ours_left, what="the janitor's connections to close")
