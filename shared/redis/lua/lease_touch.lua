-- lease_touch.lua: refresh a session's last activity (heartbeat, any command).
-- KEYS[1] duplex:session:{SID}   meta hash
-- ARGV[1] now (ms)
-- returns 1, or 0 when the session is gone or closed (never recreates the hash)
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'closed' then
  return 0
end
redis.call('HSET', KEYS[1], 'last_activity', ARGV[1])
return 1
