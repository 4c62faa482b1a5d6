-- lease_expire.lua: claim one due lease for expiry (the janitor then closes it via the worker).
-- Claiming removes the deadline, so of several janitors exactly one expires the session.
-- KEYS[1] duplex:session:{SID}   meta hash
-- KEYS[2] duplex:leases          lease deadlines
-- ARGV[1] session id   ARGV[2] now (ms)
-- returns the worker id to close it on, or false when not due / already claimed / resumed
local deadline = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not deadline or tonumber(deadline) > tonumber(ARGV[2]) then
  return false
end
redis.call('ZREM', KEYS[2], ARGV[1])
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'detached' then
  return false
end
redis.call('HSET', KEYS[1], 'state', 'closing')
return redis.call('HGET', KEYS[1], 'worker')
