-- lease_touch.lua: refresh a session's last activity (heartbeat, any command), and take
-- back a session that a sweep detached while its connection was in fact still attached.
-- A pod whose event loop stalled past the heartbeat TTL is declared dead and its sessions
-- enter disconnect grace; when it runs again, its connections touch their sessions, and
-- a touch by the attachment that still holds the session (same attachment generation)
-- makes it active again, so it is not expired at the end of the grace. Only a sweep's
-- detach is taken back: a session its own socket left stays in its grace.
-- KEYS[1] duplex:session:{SID}   meta hash
-- ARGV[1] now (ms)   ARGV[2] attachment generation of the caller (optional)
-- ARGV[3] the API pod of the caller (with ARGV[2])
-- returns 1 touched; 2 touched and reactivated (the caller unindexes its lease deadline);
--         0 when the session is gone or closed (never recreates the hash)
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'closed' then
  return 0
end
redis.call('HSET', KEYS[1], 'last_activity', ARGV[1])
if state == 'detached' and ARGV[2] and
    redis.call('HGET', KEYS[1], 'detached_by') == 'sweep' and
    redis.call('HGET', KEYS[1], 'attachment_generation') == ARGV[2] then
  redis.call('HSET', KEYS[1], 'state', 'active', 'pod', ARGV[3])
  redis.call('HDEL', KEYS[1], 'detached_at', 'lease_deadline', 'detached_by')
  return 2
end
return 1
