-- A model-native session's restore progress, in its hash's `restore` field (JSON: frames
-- to replay, replayed, seconds, pace against real time, done), for `duplex sessions show`
-- and redis-cli. Written by the worker that owns the session, and only while it does: a
-- hash that is gone (closed and expired) or whose owner_generation is another's (the
-- session moved on) is left as it is, never recreated.
-- KEYS[1] duplex:session:{SID}
-- ARGV[1] the writer's owner generation, ARGV[2] the progress JSON
-- Returns 1 when written, 0 when not.
if redis.call('HGET', KEYS[1], 'owner_generation') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'restore', ARGV[2])
return 1
