"""Following the primary Sentinel names (shared/redis/sentinel_watch.py).

`SENTINEL FAILOVER` (an operator's, or a primary cut off from the sentinels) leaves the old
primary up and taking writes until the sentinels demote it, about 11 s later with Redis 7.0.
A process must stop writing there once the sentinels have named the new primary: its idle
pooled connections, a blocking read in flight and its subscription all move, and what it
writes after the watch saw the change is on the new primary. Before the watch, redis-py's
pool kept them on the old one (writes there were lost when it was demoted, and the janitor,
reading the new primary, declared live pods and workers dead).

The epoch rule is tested on answers the test makes: a sentinel that has not heard of the
failover yet (the old primary under the old epoch) is not followed back."""

import asyncio

import pytest
import redis.asyncio as redis_async
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel

from shared.redis.connection import connect
from shared.redis.sentinel_watch import LOWER_EPOCH_FOLLOWED_AFTER_S, SentinelWatch
from tests.e2e.waits import until

SERVICE = "duplex"


def direct(port: int) -> redis_async.Redis:
    return redis_async.Redis(host="127.0.0.1", port=port)


async def test_every_connection_follows_a_sentinel_failover_whose_old_primary_stays_up(
    sentinel_set,
):
    old = sentinel_set.primary_port()
    new = sentinel_set.replica_port()
    handle = connect(sentinel_set.url)
    client = handle.client
    subscriber = client.pubsub()
    try:
        await client.set("before", 1)  # a pooled connection, idle from here on
        await subscriber.subscribe("heard")
        assert (await subscriber.get_message(timeout=5))["type"] == "subscribe"
        blocked = asyncio.create_task(client.xread({"stream": "$"}, block=0))
        await until(lambda: handle.watch.primary(), lambda address: address[1] == old)

        async with direct(next(iter(sentinel_set.sentinels))) as sentinel:
            await sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE)
        await until(
            lambda: asyncio.to_thread(sentinel_set.primary_port), lambda port: port == new, 60
        )
        await until(lambda: handle.watch.primary(), lambda address: address[1] == new, 60)
        assert handle.watch.switches == 1

        # what the process writes now lands on the new primary, whatever the old one does
        await client.set("after", 2)
        async with direct(new) as promoted:
            assert await promoted.get("after") == b"2"
        # the blocking read was on the old primary: it failed, as in an outage
        try:
            await blocked
        except Exception as exc:
            assert "closed" in str(exc).lower() or "connection" in type(exc).__name__.lower()
        else:
            raise AssertionError("the blocking read on the old primary went on")
        # the subscription is on the new primary again: it hears what is published there
        async with direct(new) as promoted:

            async def published_and_heard() -> bool:
                await promoted.publish("heard", b"x")
                message = await subscriber.get_message(timeout=0.5)
                return message is not None and message["type"] == "message"

            await until(published_and_heard, bool, 60)
    finally:
        await subscriber.aclose()
        await handle.close()


class Answers:
    """A sentinel that answers SENTINEL MASTER with a state the test sets."""

    def __init__(self, port: int, epoch: int, up: bool = True) -> None:
        self.state = {
            "ip": "10.0.0.1",
            "port": port,
            "config-epoch": epoch,
            "is_master": True,
            "is_sdown": not up,
            "is_odown": False,
            "num-other-sentinels": 2,
        }

    async def sentinel_master(self, service: str) -> dict:
        return self.state


class Sentinels:
    """What the watch reads of redis-py's Sentinel manager: its sentinels, and its test of
    a valid answer (redis-py's own)."""

    def __init__(self, *answers: Answers) -> None:
        self.sentinels = list(answers)
        self.min_other_sentinels = 0

    check_master_state = Sentinel.check_master_state


async def test_the_highest_config_epoch_is_followed_and_a_lagging_sentinel_is_not():
    leader, lagging, third = Answers(7001, 1), Answers(7000, 0), Answers(7000, 0)
    watch = SentinelWatch(Sentinels(lagging, leader, third), SERVICE)  # type: ignore[arg-type]
    try:
        await watch.look(now=0.0)  # (look, not primary: no loop of its own beside the test)
        assert watch.address == ("10.0.0.1", 7001)  # the leader's epoch wins
        leader.state["is_sdown"] = True  # the leader away: the other two lag behind
        await watch.look(now=100.0)
        await watch.look(now=100.0 + LOWER_EPOCH_FOLLOWED_AFTER_S - 1)
        assert (watch.address, watch.switches) == (("10.0.0.1", 7001), 0)
        leader.state["is_sdown"] = False  # back: the disagreement ends
        await watch.look(now=200.0)
        leader.state["is_sdown"] = True
        await watch.look(now=210.0)  # the count starts again
        await watch.look(now=210.0 + LOWER_EPOCH_FOLLOWED_AFTER_S - 1)
        assert watch.address == ("10.0.0.1", 7001)
        # a sentinel set deployed afresh (every epoch 0 again) that keeps naming another
        # primary for longer than a failover takes to spread is followed
        await watch.look(now=210.0 + LOWER_EPOCH_FOLLOWED_AFTER_S)
        assert (watch.address, watch.epoch, watch.switches) == (("10.0.0.1", 7000), 0, 1)
    finally:
        await watch.stop()


async def test_the_leader_names_the_old_primary_under_the_new_epoch_before_it_switches():
    """What three sentinels answered every 20 ms through a SENTINEL FAILOVER (Redis
    7.0.15): the leader first names the old primary under epoch 1, then the new one; a
    sentinel still naming the old one under epoch 1 then is behind, and not followed back.
    And while every sentinel that answers says the primary is down, nothing is named."""
    leader, second, third = Answers(7000, 0), Answers(7000, 0), Answers(7000, 0)
    watch = SentinelWatch(Sentinels(leader, second, third), SERVICE)  # type: ignore[arg-type]
    try:
        await watch.look(now=0.0)
        leader.state["config-epoch"] = 1  # promoted, not switched yet
        await watch.look(now=1.0)
        assert (watch.address, watch.epoch, watch.switches) == (("10.0.0.1", 7000), 1, 0)
        leader.state["port"] = second.state["port"] = 7001  # switched; the third is behind
        second.state["config-epoch"] = 1
        third.state["config-epoch"] = 1
        for now in (1.1, 1.2):
            await watch.look(now=now)
            assert (watch.address, watch.switches) == (("10.0.0.1", 7001), 1)
        for answer in (leader, second, third):
            answer.state["is_sdown"] = True
        await watch.look(now=2.0)
        assert watch.down
        with pytest.raises(MasterNotFoundError):
            await watch.primary()
    finally:
        await watch.stop()
