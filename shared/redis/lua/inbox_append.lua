-- inbox_append.lua: add one command to a worker's inbox, within the inbox's byte budget.
-- An inbox holds only what its worker has not handled yet (the worker deletes what it
-- handled: inbox_ack.lua), so its size is the worker's backlog. The budget bounds that
-- backlog in bytes as MAXLEN bounds it in entries: a client that writes faster than the
-- worker reads is refused here instead of filling Redis.
-- KEYS[1] duplex:worker:{WID}:inbox         stream
-- KEYS[2] duplex:worker:{WID}:inbox_bytes   string: bytes of the entries not yet handled
-- ARGV[1] byte budget (0: no budget, for control messages such as close)
-- ARGV[2] MAXLEN (approximate)   ARGV[3] the entry's size in bytes (payload + audio)
-- ARGV[4..] field, value, field, value, ...
-- returns the inbox's bytes after the append, or -1 when the budget refused it (nothing added)
local budget = tonumber(ARGV[1])
local size = tonumber(ARGV[3])
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
if budget > 0 and used + size > budget then
  return -1
end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 4))
return redis.call('INCRBY', KEYS[2], size)
