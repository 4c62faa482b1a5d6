"""The janitor's own events (services/api/janitor.py) follow the session's surface: an
openai-surface session's worker_lost error goes out without `server_event_seq`."""

import fakeredis
import orjson
import pytest

from services.api.inbox_writer import InboxWriter
from services.api.janitor import Janitor
from services.api.live import LiveHub
from services.api.worker_client import WorkerClient
from shared.contracts import SessionRuntimeConfig
from shared.redis.connection import RedisHandle
from shared.redis.live_message import openai_surface
from shared.redis.placement import WorkerDirectory
from shared.redis.store import PublishItem, SessionStore
from tests.api.parts import JOURNAL, KEYS

DEAD = "w-dead"


@pytest.fixture
async def janitor():
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    store = SessionStore(client, KEYS)
    workers = WorkerClient(InboxWriter(client, KEYS, store.scripts))
    yield Janitor(
        RedisHandle(client, "test"),
        KEYS,
        store,
        workers,
        SessionRuntimeConfig(),
        heartbeat_ttl_s=5.0,
        disconnect_grace_s=30.0,
        directory=WorkerDirectory(client, KEYS, heartbeat_ttl_s=5.0),
        live=LiveHub(client, KEYS.api("api-t")),
    )
    await workers.stop()
    await client.aclose()


def test_the_surface_is_read_from_the_config_in_the_hash():
    assert openai_surface({"config": '{"model":"echo","duplex_surface":"openai"}'})
    assert not openai_surface({"config": '{"model":"echo"}'})
    assert not openai_surface({"config": "not json"}) and not openai_surface({})


@pytest.mark.parametrize(
    "config, seq_in_json", [("{}", True), ('{"duplex_surface":"openai"}', False)]
)
async def test_a_lost_sessions_error_follows_its_surface(janitor, config, seq_in_json):
    sid = "duplex-lost"
    await janitor.store.open(sid, DEAD, "echo", "", config)
    created = PublishItem(b'{"type":"session.created"}', "session.created", False, b"{}")
    await janitor.store.publish(sid, [created], **JOURNAL)
    assert await janitor._close_lost(DEAD, sid, await janitor.store.meta(sid))
    records = await janitor.store.journal_records(sid, 0)
    assert [r.wire_type for r in records] == ["error", "session.closed"]
    assert [r.seq for r in records] == [1, 2]
    assert [("server_event_seq" in orjson.loads(r.data)) for r in records] == [seq_in_json] * 2
