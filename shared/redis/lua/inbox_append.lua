-- inbox_append.lua: add one command to a worker's inbox, within the inbox's budget.
-- An inbox holds only what its worker has not handled yet (the worker deletes what it
-- handled: inbox_ack.lua), so its size is the worker's backlog. The budget bounds that
-- backlog in bytes and in entries: a client that writes faster than the worker reads is
-- refused here instead of filling Redis. Nothing is ever trimmed: a trim could only drop
-- commands nobody has handled yet.
-- KEYS[1] duplex:worker:{WID}:inbox         stream
-- KEYS[2] duplex:worker:{WID}:inbox_bytes   string: bytes of the entries not yet handled
-- ARGV[1] byte budget (0: none, for control messages such as close, which always pass)
-- ARGV[2] entry budget (with the byte budget)   ARGV[3] the entry's size in bytes
-- ARGV[4..] field, value, field, value, ...
-- returns the inbox's bytes after the append, or -1 when the budget refused it (nothing added)
local budget = tonumber(ARGV[1])
local size = tonumber(ARGV[3])
if budget > 0 then
  local used = tonumber(redis.call('GET', KEYS[2]) or '0')
  if used + size > budget or redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[2]) then
    return -1
  end
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 4))
return redis.call('INCRBY', KEYS[2], size)
