-- inbox_append.lua: add one entry to a worker's inbox, within the inbox's budget.
-- An entry is one message, or a pack of the messages an API pod's writer round has for this
-- worker (shared/redis/inbox_codec.py): one call, one INCRBY and one XADD for all of them.
-- An inbox holds only what its worker has not handled yet (the worker deletes what it
-- handled: inbox_ack.lua), so its size is the worker's backlog. The budget bounds that
-- backlog: a client that writes faster than the worker reads is refused here instead of
-- filling Redis. Every entry costs at least 640 bytes of it (MIN_ENTRY_BYTES), so the
-- budget bounds the count of entries too. Nothing is ever trimmed: a trim could only
-- drop commands nobody has handled yet.
-- KEYS[1] duplex:worker:{WID}:inbox         stream
-- KEYS[2] duplex:worker:{WID}:inbox_bytes   string: what the entries not yet handled cost
-- ARGV[1] budget in bytes (0: none, for entries of control messages only, which always pass)
-- ARGV[2] what the entry costs   ARGV[3..] field, value, field, value, ...
-- returns the inbox's cost after the append, or -1 when the budget refused it (nothing added)
local budget = tonumber(ARGV[1])
local size = tonumber(ARGV[2])
-- counted first: the common case (it fits) runs no GET
local total = redis.call('INCRBY', KEYS[2], size)
if budget > 0 and total > budget then
  redis.call('DECRBY', KEYS[2], size)
  return -1
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
return total
