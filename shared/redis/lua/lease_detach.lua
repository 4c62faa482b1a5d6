-- lease_detach.lua: a connection dropped; start the disconnect grace period.
-- Fenced: only the attachment that still holds the session may detach it.
-- Touches one slot (Redis Cluster): the caller indexes the deadline in
-- duplex:leases afterwards; the deadline itself lives in the hash.
-- KEYS[1] duplex:session:{SID}   meta hash
-- ARGV[1] attachment generation the connection held   ARGV[2] now (ms)   ARGV[3] disconnect grace (ms)
-- ARGV[4] who detaches it: "client" (its socket closed) or "sweep" (its pod was declared
--         dead); only a sweep's detach can be taken back by the pod (lease_touch.lua)
-- returns the lease deadline (ms) when detached; 0 a newer attachment holds it (no-op);
--         -1 unknown; -2 closed
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return -1
end
if state == 'closed' or state == 'closing' then
  return -2
end
if redis.call('HGET', KEYS[1], 'attachment_generation') ~= ARGV[1] then
  return 0
end
local deadline = tonumber(ARGV[2]) + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'state', 'detached', 'detached_at', ARGV[2], 'last_activity', ARGV[2],
  'lease_deadline', deadline, 'detached_by', ARGV[4] or 'client')
return deadline
