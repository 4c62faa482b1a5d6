-- lease_detach.lua: a connection dropped; start the disconnect grace period.
-- Fenced: only the attachment that still holds the session may detach it.
-- KEYS[1] duplex:session:{SID}   meta hash
-- KEYS[2] duplex:leases          lease deadlines (zset: session id -> ms)
-- ARGV[1] session id   ARGV[2] attachment generation the connection held
-- ARGV[3] now (ms)     ARGV[4] disconnect grace (ms)
-- returns 1 detached; 0 a newer attachment holds it (no-op); -1 unknown; -2 closed
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return -1
end
if state == 'closed' or state == 'closing' then
  return -2
end
if redis.call('HGET', KEYS[1], 'attachment_generation') ~= ARGV[2] then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'detached', 'detached_at', ARGV[3], 'last_activity', ARGV[3])
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]) + tonumber(ARGV[4]), ARGV[1])
return 1
