"""The live hub (services/api/live.py): one pub/sub reader per pod, run as a supervised
loop; after a lost connection it subscribes every channel again and tells each
subscriber to catch up from the journal."""

import fakeredis

from services.api.live import CATCH_UP, LiveFeed, LiveHub
from shared.redis.keys import KeySchema

KEYS = KeySchema()


async def test_a_lost_connection_is_resubscribed_and_every_subscriber_catches_up():
    client = fakeredis.FakeAsyncRedis(server=fakeredis.FakeServer())
    hub = LiveHub(client, KEYS.api("api-t"))
    feed, other = LiveFeed(), LiveFeed()
    channel = KEYS.live("duplex-l")
    real_listen = hub.pubsub.listen

    def lost_once():
        hub.pubsub.listen = real_listen

        async def fail():
            raise ConnectionError("Redis went away")
            yield  # an async generator, like listen()

        return fail()

    hub.pubsub.listen = lost_once  # the reader's first listen fails
    await hub.subscribe(channel, feed.push)  # not connected yet: recorded for the reconnect
    await hub.subscribe(channel, other.push)
    await hub.start()
    assert await feed.get() == CATCH_UP and await other.get() == CATCH_UP
    assert hub.connected.is_set() and hub._reader.failures == 1
    await client.publish(channel, b'{"type":"e1"}')
    assert await feed.get() == b'{"type":"e1"}' and await other.get() == b'{"type":"e1"}'
    await hub.unsubscribe(channel, other.push)
    assert hub.listening(channel)
    await hub.unsubscribe(channel, feed.push)
    assert not hub.listening(channel)
    await hub.stop()
    assert not hub._reader.running
    await client.aclose()
