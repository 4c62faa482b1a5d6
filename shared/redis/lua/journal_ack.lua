-- journal_ack.lua: the client has every event up to seq: drop them from the journal.
-- KEYS[1] duplex:session:{SID}          meta hash
-- KEYS[2] duplex:session:{SID}:events   journal stream
-- ARGV[1] acknowledged server_event_seq
-- returns the new first retained seq; -1 when seq is past the head; -2 when the session is gone
local seq = tonumber(ARGV[1])
local next_seq = tonumber(redis.call('HGET', KEYS[1], 'next_seq'))
if not next_seq then
  return -2
end
if seq > next_seq then
  return -1
end
local freed = 0
for _, entry in ipairs(redis.call('XRANGE', KEYS[2], '-', seq .. '-1')) do
  freed = freed + #entry[2][4]
  redis.call('XDEL', KEYS[2], entry[1])
end
if freed > 0 then
  redis.call('HINCRBY', KEYS[1], 'journal_bytes', -freed)
end
local first = math.max(tonumber(redis.call('HGET', KEYS[1], 'journal_first_seq')), seq + 1)
redis.call('HSET', KEYS[1], 'journal_first_seq', first)
return first
