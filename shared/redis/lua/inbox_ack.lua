-- inbox_ack.lua: a worker has handled these inbox entries: acknowledge and delete them.
-- Deleting (not only XACK) is what keeps an append's audio from staying in Redis after
-- its command ran; the byte counter of inbox_append.lua is given back at the same time.
-- KEYS[1] duplex:worker:{WID}:inbox         stream
-- KEYS[2] duplex:worker:{WID}:inbox_bytes   string: bytes of the entries not yet handled
-- ARGV[1] consumer group   ARGV[2] bytes of these entries   ARGV[3..] entry ids
-- returns how many entries were deleted
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
local deleted = redis.call('XDEL', KEYS[1], unpack(ARGV, 3))
local left = redis.call('DECRBY', KEYS[2], ARGV[2])
-- An empty inbox holds 0 bytes whatever the counter says: this heals the counter after
-- MAXLEN trimmed entries that were counted, or a sweep deleted the stream but not it.
if left < 0 or redis.call('XLEN', KEYS[1]) == 0 then
  redis.call('SET', KEYS[2], 0)
end
return deleted
