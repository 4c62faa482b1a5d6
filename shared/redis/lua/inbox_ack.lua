-- inbox_ack.lua: a worker has handled these inbox entries: acknowledge and delete them.
-- Deleting (not only XACK) is what keeps an append's audio from staying in Redis after
-- its command ran; each deleted entry gives what it cost back to the budget of
-- inbox_append.lua. Only entries this call really deleted count, so an ack sent again
-- (its reply was lost) gives nothing back twice. The worker sends its acks in batches
-- (services/worker/inbox_reader.py), with no id at all when its inbox went quiet.
-- KEYS[1] duplex:worker:{WID}:inbox         stream
-- KEYS[2] duplex:worker:{WID}:inbox_bytes   string: what the entries not yet handled cost
-- ARGV[1] consumer group
-- ARGV[2] 1: also set the counter to 0 should the inbox be empty (one XLEN), 0: not
-- ARGV[3..] entry id, its cost, entry id, cost, ...
--         (at most a few thousand values a call: Lua unpacks no more than about 8000)
-- returns how many entries were deleted
local ids, total = {}, 0
for i = 3, #ARGV, 2 do
  ids[#ids + 1] = ARGV[i]
  total = total + tonumber(ARGV[i + 1])
end
local deleted, freed = 0, 0
if #ids > 0 then
  if redis.call('XACK', KEYS[1], ARGV[1], unpack(ids)) == #ids then
    -- every one was still pending, so every one is still in the stream: one XDEL (the
    -- common case, a batch of entries in one command instead of one per entry)
    deleted, freed = redis.call('XDEL', KEYS[1], unpack(ids)), total
  else
    -- some were acknowledged (and deleted) already: give back only what goes now
    for i = 3, #ARGV, 2 do
      if redis.call('XDEL', KEYS[1], ARGV[i]) == 1 then
        deleted = deleted + 1
        freed = freed + tonumber(ARGV[i + 1])
      end
    end
  end
end
local left
if freed > 0 then
  left = redis.call('DECRBY', KEYS[2], freed)
end
-- Below 0 it can only be wrong; an empty inbox costs nothing whatever the counter says
-- (this heals it should a sweep have deleted the stream but not it): that is looked at
-- only when asked (the worker asks when its inbox goes quiet), not on every batch.
if (left ~= nil and left < 0) or (ARGV[2] == '1' and redis.call('XLEN', KEYS[1]) == 0) then
  redis.call('SET', KEYS[2], 0)
end
return deleted
