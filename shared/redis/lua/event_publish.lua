-- event_publish.lua: publish a batch of one session's events, in order.
-- For each journaled event: seq = ++next_seq, stamp "server_event_seq" on the
-- JSON, XADD it to the journal as entry <seq>-1, prune the oldest entries past
-- the byte cap. Every event then goes to the live channel (PUBLISH).
-- The owning worker fences every call on its owner generation: a worker that lost the
-- session (declared dead, the session re-placed) is refused before anything is written.
-- With a checkpoint, the same call stores it after the events, so the checkpoint always
-- matches the journal up to the last event of the call (a failover restores both at once).
-- KEYS[1] duplex:session:{SID}              meta hash
-- KEYS[2] duplex:session:{SID}:events       journal stream
-- KEYS[3] duplex:session:{SID}:checkpoint   string: the session's checkpoint JSON
-- ARGV[1] live channel   ARGV[2] journal max bytes   ARGV[3] journal TTL (ms)
-- ARGV[4] now (ms)       ARGV[5] closed-session key TTL (ms)
-- ARGV[6] an event id for the session.resync_required notice, should the journal overflow
-- ARGV[7] the caller's owner generation ("": not an owner; the janitor and operators)
-- ARGV[8] a checkpoint JSON to store after the events ("": none)
-- then per event, 4 values: journaled ("1"/"0"), type, event JSON (compact, ends in "}"),
--   session object JSON ("" unless the event carries the session: created/updated)
-- returns one seq per event (0 = not journaled); {-1} when the session is gone;
--         {-2} when the caller is not the session's owner (nothing written)
local meta, journal, checkpoint = KEYS[1], KEYS[2], KEYS[3]
local channel, max_bytes, ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('EXISTS', meta) == 0 then
  return {-1}
end
if ARGV[7] ~= '' and redis.call('HGET', meta, 'owner_generation') ~= ARGV[7] then
  return {-2}
end
local seqs = {}
for i = 9, #ARGV, 4 do
  local journaled, etype, data, session = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if session ~= '' then
    redis.call('HSET', meta, 'session', session)
  end
  if etype == 'session.created' then
    redis.call('HSET', meta, 'state', 'active')
  end
  local seq = 0
  local out = data
  if journaled == '1' and redis.call('HGET', meta, 'journal_overflow') ~= '1' then
    seq = redis.call('HINCRBY', meta, 'next_seq', 1)
    out = string.sub(data, 1, -2) .. ',"server_event_seq":' .. seq .. '}'
    if #out > max_bytes then
      -- one event larger than the whole journal: replay is impossible from now on (sticky)
      redis.call('HSET', meta, 'journal_overflow', 1, 'journal_bytes', 0)
      redis.call('DEL', journal)
      local sid = string.match(meta, '{(.-)}')
      local notice = '{"type":"session.resync_required","event_id":"' .. ARGV[6] ..
        '","session_id":"' .. sid .. '","reason":"journal_overflow"}'
      redis.call('PUBLISH', channel, notice)
      seq = 0
      out = data
    else
      redis.call('XADD', journal, seq .. '-1', 'type', etype, 'data', out)
      local bytes = redis.call('HINCRBY', meta, 'journal_bytes', #out)
      while bytes > max_bytes do
        local oldest = redis.call('XRANGE', journal, '-', '+', 'COUNT', 1)[1]
        redis.call('XDEL', journal, oldest[1])
        bytes = redis.call('HINCRBY', meta, 'journal_bytes', -#oldest[2][4])
        redis.call('HSET', meta, 'journal_first_seq', tonumber(string.match(oldest[1], '^(%d+)')) + 1)
      end
      redis.call('PEXPIRE', journal, ttl_ms)
    end
  end
  if etype == 'session.closed' then
    redis.call('DEL', checkpoint)  -- nothing restores a closed session
    redis.call('HSET', meta, 'state', 'closed', 'closed_at', ARGV[4])
    redis.call('PEXPIRE', meta, tonumber(ARGV[5]))
    redis.call('PEXPIRE', journal, tonumber(ARGV[5]))
  end
  redis.call('PUBLISH', channel, out)
  seqs[#seqs + 1] = seq
end
if ARGV[8] ~= '' and redis.call('HGET', meta, 'state') ~= 'closed' then
  redis.call('SET', checkpoint, ARGV[8])
  redis.call('HINCRBY', meta, 'checkpoints', 1)
end
return seqs
