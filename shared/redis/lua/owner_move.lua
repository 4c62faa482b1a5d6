-- owner_move.lua: hand a session to another worker (drain) or re-place it (failover).
-- Compare-and-set on the owner: only when the session is still on `from` with owner
-- generation `expected` does it move; the generation is bumped, so every later write of
-- the old owner (event_publish.lua, fenced on it) is refused. The worker's session sets
-- live in other slots: the caller moves the id between them.
-- KEYS[1] duplex:session:{SID}   meta hash
-- ARGV[1] from worker   ARGV[2] expected owner generation ("": whatever it is)
-- ARGV[3] to worker     ARGV[4] now (ms)   ARGV[5] why: drain | worker_lost
-- ARGV[6] when the old owner stopped serving the session (ms; "" = unknown, a failover):
--         with the new owner's `restored_at`, the pause the move caused
-- returns the new owner generation; 0 when the session is gone, closed, or not where the
--         caller thought (another sweep or a newer owner moved it first)
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'closed' or state == 'opening' then
  return 0
end
if redis.call('HGET', KEYS[1], 'worker') ~= ARGV[1] then
  return 0
end
local generation = redis.call('HGET', KEYS[1], 'owner_generation') or '1'
if ARGV[2] ~= '' and generation ~= ARGV[2] then
  return 0
end
local moved = tonumber(generation) + 1
redis.call('HSET', KEYS[1], 'worker', ARGV[3], 'owner_generation', moved,
  'moved_at', ARGV[4], 'moved_from', ARGV[1], 'moved_why', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'moves', 1)
redis.call('HDEL', KEYS[1], 'restored_at', 'paused_at')
if ARGV[6] and ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'paused_at', ARGV[6])
end
return moved
