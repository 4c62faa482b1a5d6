-- lease_resume.lua: a new connection proves it owns the session and takes it over.
-- Token check (constant time), journal check, lease-generation CAS, token
-- rotation and attachment-generation bump happen as one atomic step, so of
-- two concurrent resumes exactly one wins.
-- KEYS[1] duplex:session:{SID}          meta hash
-- KEYS[2] duplex:session:{SID}:events   journal stream
-- (one slot: the caller drops the deadline from duplex:leases afterwards)
-- ARGV[1] session id   ARGV[2] SHA-256 of the presented token   ARGV[3] SHA-256 of the new token
-- ARGV[4] last received server_event_seq   ARGV[5] now (ms)   ARGV[6] the API pod attaching it
-- ARGV[7] SHA-256 of the API key presented ("" without keys): a session opened with a key
--         resumes only with that key, answered like a wrong token (nothing to learn)
-- returns {"ok", attachment_generation, lease_generation, worker, next_seq, session JSON, model}
--      or {"resync", reason} (journal_overflow; journal_gap: events past the last one are
--         gone, or the client has events past the head, which a Redis failover lost)
--      or an error reply: session_resume_expired | invalid_resume_token |
--         session_resume_conflict
local meta = KEYS[1]
local state = redis.call('HGET', meta, 'state')
if not state or state == 'closed' or state == 'closing' or state == 'opening' then
  return redis.error_reply('session_resume_expired')
end
local function same(a, b)
  -- constant-time comparison of two hex digests
  if not a or #a ~= #b then return false end
  local diff = 0
  for i = 1, #a do
    if string.byte(a, i) ~= string.byte(b, i) then diff = diff + 1 end
  end
  return diff == 0
end
local opened_with = redis.call('HGET', meta, 'key_sha256')
if opened_with and opened_with ~= '' and not same(opened_with, ARGV[7] or '') then
  return redis.error_reply('invalid_resume_token')
end
local stored = redis.call('HGET', meta, 'resume_token_sha256')
if stored == '' or not same(stored, ARGV[2]) then
  if same(redis.call('HGET', meta, 'previous_token_sha256'), ARGV[2]) then
    return redis.error_reply('session_resume_conflict')
  end
  return redis.error_reply('invalid_resume_token')
end
local last = tonumber(ARGV[4])
local next_seq = tonumber(redis.call('HGET', meta, 'next_seq'))
if redis.call('HGET', meta, 'journal_overflow') == '1' then
  return {'resync', 'journal_overflow'}
end
if last > next_seq then
  -- the client holds events this store never journaled: a failover lost the writes that
  -- journaled them (replication is asynchronous). Nothing can be replayed past what it
  -- has without seqs going back: a gap, and the client starts over
  return {'resync', 'journal_gap'}
end
-- the oldest entry's id is the first seq it holds (one entry per publisher round), so the
-- first seq still replayable is exact whether that entry is whole or partly acknowledged
local first = tonumber(redis.call('HGET', meta, 'journal_first_seq'))
local oldest = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 1)[1]
if oldest then
  first = math.max(first, tonumber(string.match(oldest[1], '^(%d+)')))
elseif next_seq > 0 then
  first = next_seq + 1  -- the journal expired: nothing older than the next event is kept
end
if last < next_seq and last + 1 < first then
  return {'resync', 'journal_gap'}
end
local lease = redis.call('HINCRBY', meta, 'lease_generation', 1)
local attachment = redis.call('HINCRBY', meta, 'attachment_generation', 1)
redis.call('HSET', meta, 'previous_token_sha256', ARGV[2], 'resume_token_sha256', ARGV[3],
  'state', 'active', 'last_activity', ARGV[5], 'pod', ARGV[6])
redis.call('HDEL', meta, 'detached_at', 'lease_deadline', 'detached_by')
return {'ok', attachment, lease, redis.call('HGET', meta, 'worker'), next_seq,
  redis.call('HGET', meta, 'session') or '', redis.call('HGET', meta, 'model')}
