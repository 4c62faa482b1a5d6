"""A Redis Sentinel set on loopback ports for the tests (a primary, one replica and three
sentinels that fail the primary over to the replica when it dies: what a
`redis+sentinel://` DUPLEX_REDIS_URL names in a deployment). It is the product's own, the
one `duplex serve --redis-sentinel` runs on (services/local_redis.py): the tests start the
set users try failovers with."""

from services.local_redis import DOWN_AFTER_MS, SERVICE, RedisSentinelSet

__all__ = ["DOWN_AFTER_MS", "SERVICE", "RedisSentinelSet"]
