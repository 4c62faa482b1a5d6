-- journal_ack.lua: the client has every event up to seq: drop them from the journal.
-- An entry holds one publisher round (event_publish.lua): it goes once its last seq is
-- acknowledged; an entry only partly acknowledged stays whole (a replay skips the records
-- at or below the seq it resumes from), and journal_first_seq still moves past the ack.
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
local doomed = {}
for _, entry in ipairs(redis.call('XRANGE', KEYS[2], '-', seq .. '-1')) do
  local fields = entry[2]
  -- an entry of an older worker holds one event: its id is its seq
  local last = fields[1] == 'last' and tonumber(fields[2])
    or tonumber(string.match(entry[1], '^(%d+)'))
  if last > seq then
    break  -- the entry holding seq+1: kept (entries are in seq order, the rest are newer)
  end
  freed = freed + #fields[4]  -- data is the second field in both entry shapes
  doomed[#doomed + 1] = entry[1]
end
-- XDEL in slices: unpack has a limit on how many values it spreads
for start = 1, #doomed, 1000 do
  redis.call('XDEL', KEYS[2], unpack(doomed, start, math.min(start + 999, #doomed)))
end
if freed > 0 then
  redis.call('HINCRBY', KEYS[1], 'journal_bytes', -freed)
end
local first = math.max(tonumber(redis.call('HGET', KEYS[1], 'journal_first_seq')), seq + 1)
redis.call('HSET', KEYS[1], 'journal_first_seq', first)
return first
