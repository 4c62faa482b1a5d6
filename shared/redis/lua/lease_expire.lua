-- lease_expire.lua: claim one due lease for expiry (the janitor then closes it via the worker).
-- Claiming moves the session to "closing", so of several janitors exactly one expires it;
-- a session resumed meanwhile is no longer detached and is left alone.
-- KEYS[1] duplex:session:{SID}   meta hash
-- ARGV[1] now (ms)
-- returns the worker id to close it on, or false when not due / already claimed / resumed
if redis.call('HGET', KEYS[1], 'state') ~= 'detached' then
  return false
end
local deadline = tonumber(redis.call('HGET', KEYS[1], 'lease_deadline') or '0')
if deadline > tonumber(ARGV[1]) then
  return false
end
redis.call('HSET', KEYS[1], 'state', 'closing')
return redis.call('HGET', KEYS[1], 'worker')
