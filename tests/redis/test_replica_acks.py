"""The writes a failover must not lose wait for a replica (`replica_acks`, WAIT on the same
connection as the script): a resume's token rotation and an owner move are on the replica
when the call returns; a replica that does not answer in time leaves the write standing,
counted and logged once. Real redis-servers: a primary and its replica."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.asyncio as redis_async

from harness.redis_server import RedisServer
from shared.redis.store import (
    PublishItem,
    ResumeGranted,
    SessionStore,
    SessionStoreError,
    token_digest,
)
from tests.redis.test_journal_rounds import JOURNAL, KEYS


@pytest.fixture
async def primary_and_replica():
    primary, replica = RedisServer(), RedisServer()
    a = redis_async.Redis(port=primary.port)
    b = redis_async.Redis(port=replica.port)
    try:  # the servers stop even when the replica never syncs
        await a.config_set("repl-diskless-sync-delay", 0)  # sync at once, not after 5 s
        await b.execute_command("REPLICAOF", "127.0.0.1", primary.port)
        async with asyncio.timeout(20):
            while (await b.info("replication")).get("master_link_status") != "up":
                await asyncio.sleep(0.05)
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()
        replica.stop()
        primary.stop()


async def opened(client, sid: str, store: SessionStore) -> None:
    for script in store.scripts.all():  # loaded: no call is sent twice (NOSCRIPT)
        await script.ensure_loaded(client)
    await store.open(sid, "worker-a", "echo", token_digest("tok-0"), "{}")
    created = PublishItem(b'{"type":"session.created"}', "session.created", journaled=False)
    await store.publish(sid, [created], **JOURNAL)


async def waits(client) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


async def test_a_resume_and_a_move_are_on_the_replica_when_they_return(primary_and_replica):
    primary, replica = primary_and_replica
    store = SessionStore(primary, KEYS, replica_acks=1, replica_ack_timeout_ms=5000)
    await opened(primary, "duplex-acked", store)
    granted = await store.resume("duplex-acked", "tok-0", "tok-1", 0)
    assert isinstance(granted, ResumeGranted)
    # read from the replica at once: the rotated token is there (WAIT returned after it)
    meta = KEYS.session("duplex-acked")
    assert (await replica.hget(meta, "resume_token_sha256")).decode() == token_digest("tok-1")
    assert await store.move_owner("duplex-acked", "worker-a", "worker-b", "drain", 1) == 2
    assert await replica.hget(meta, "owner_generation") == b"2"
    assert await waits(primary) == 2 and store.unacked == 0


async def test_without_acks_nothing_waits(primary_and_replica):
    primary, _ = primary_and_replica
    store = SessionStore(primary, KEYS)
    await opened(primary, "duplex-plain", store)
    assert isinstance(await store.resume("duplex-plain", "tok-0", "tok-1", 0), ResumeGranted)
    assert await waits(primary) == 0


async def test_a_replica_that_does_not_answer_leaves_the_write_standing(
    primary_and_replica, caplog
):
    primary, replica = primary_and_replica
    await replica.execute_command("REPLICAOF", "NO", "ONE")  # the primary has no replica now
    store = SessionStore(primary, KEYS, replica_acks=1, replica_ack_timeout_ms=50)
    await opened(primary, "duplex-alone", store)
    with caplog.at_level(logging.WARNING, logger="shared.redis.store"):
        assert isinstance(await store.resume("duplex-alone", "tok-0", "tok-1", 0), ResumeGranted)
        assert await store.move_owner("duplex-alone", "worker-a", "worker-b", "drain", 1) == 2
    assert store.unacked == 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "0 of 1 replicas acknowledged" in said[0]
    # a refusal is still a refusal (the script's error, not the WAIT's)
    with pytest.raises(SessionStoreError) as refused:
        await store.resume("duplex-alone", "not-the-token", "tok-2", 0)
    assert refused.value.code == "invalid_resume_token"
