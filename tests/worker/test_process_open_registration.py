"""An open joins the worker's session set (the set the dead-worker sweep and `leave` read)
before the session is served: a session served but missing from it would be neither
failed over nor closed if the worker died. In-process workers on a real redis-server, with
a fault injected into the SADD."""

from __future__ import annotations

from typing import Any

import pytest
from redis import exceptions as redis_errors

from shared.redis.boundary import OpenRequest
from tests.worker.test_process_fleet import Fleet, Live, until

SID = "duplex-00000000000000000000000000f0a1"
KEPT = "duplex-00000000000000000000000000f0a2"


@pytest.fixture
async def fleet(redis_server):
    made = Fleet(redis_server.url)
    yield made
    await made.close()


def failing_sadd(fleet: Fleet, worker_id: str) -> Any:
    """The client's SADD, failing (a lost connection) for the worker's session set."""
    real = fleet.client.sadd
    key = fleet.keys.worker_sessions(worker_id)

    async def sadd(name: Any, *values: Any) -> Any:
        if name == key:
            raise redis_errors.ConnectionError("injected: the SADD did not reach Redis")
        return await real(name, *values)

    return sadd


async def ask_open(fleet: Fleet, worker_id: str, session_id: str) -> Live:
    """An open as an API pod writes it; the live channel it is answered on."""
    await fleet.store.open(session_id, worker_id, "echo", "", "{}")
    live = await fleet.live(session_id)
    await fleet.store.inbox_append(worker_id, OpenRequest(session_id, {}).to_fields())
    return live


async def answer(live: Live) -> dict[str, Any]:
    """The open's answer: session.created, or the error refusing it."""
    return await live.event(lambda e: e["type"] in ("session.created", "error"))


async def in_set(fleet: Fleet, worker_id: str, session_id: str) -> bool:
    return bool(await fleet.client.sismember(fleet.keys.worker_sessions(worker_id), session_id))


async def test_an_open_whose_registration_fails_is_refused_not_served_unlisted(fleet, monkeypatch):
    a = await fleet.worker("w-a")
    monkeypatch.setattr(fleet.client, "sadd", failing_sadd(fleet, "w-a"))
    live = await ask_open(fleet, "w-a", SID)
    first = await answer(live)
    # it was served while missing from the set: had w-a died, the sweep never saw it
    assert first["type"] == "error", live.events
    assert first["error"]["code"] == "internal_error"
    assert "session.created" not in [e["type"] for e in live.events]
    assert SID not in a.manager.table.live_ids() and a.manager.table.slots_in_use == 0
    assert not await in_set(fleet, "w-a", SID)
    # Redis back: the next open is served, and listed
    monkeypatch.undo()
    again = await ask_open(fleet, "w-a", KEPT)
    assert (await answer(again))["type"] == "session.created"
    assert await in_set(fleet, "w-a", KEPT)


async def test_an_open_the_worker_refuses_leaves_no_entry_in_its_set(fleet):
    a = await fleet.worker("w-a", max_sessions=1)
    await fleet.open("w-a", KEPT)  # its one slot
    live = await ask_open(fleet, "w-a", SID)
    refused = await answer(live)
    assert refused["error"]["code"] == "resource_exhausted"
    await until(lambda: _members(fleet, "w-a", {KEPT}))
    assert a.manager.table.live_ids() == [KEPT]


async def test_a_second_open_of_a_held_session_keeps_it_in_the_set(fleet):
    a = await fleet.worker("w-a")
    live = await fleet.open("w-a", SID)
    await fleet.store.inbox_append("w-a", OpenRequest(SID, {}).to_fields())
    refused = await live.of_type("error")
    assert refused["error"]["code"] == "session_exists"
    assert await in_set(fleet, "w-a", SID)
    assert a.manager.table.live_ids() == [SID]


async def _members(fleet: Fleet, worker_id: str, expected: set[str]) -> bool:
    members = await fleet.client.smembers(fleet.keys.worker_sessions(worker_id))
    return {m.decode() for m in members} == expected
