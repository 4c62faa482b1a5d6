-- event_publish.lua: publish a batch of one session's events, in order, in one live message,
-- and journal them in one entry.
-- For each journaled event: seq = next_seq + 1, optionally stamp "server_event_seq" on the
-- JSON (the duplex surface; the openai surface's JSON goes without), and frame it as a
-- record "<seq> <length> <type> <response id>\n<JSON>" (shared/redis/live_message.py).
-- The call's records go to the live channel as ONE message; an unjournaled event
-- (session.created, a refused open's error) goes alone as bare JSON, between the frames
-- before and after it, so an open's first reply is plain JSON.
-- The journal gets ONE entry per call (none when nothing is journaled): id
-- "<first seq of the call>-1", fields last (the call's last seq) and data (the journaled
-- records, framed exactly as on the live channel), so a replay splits an entry as the pump
-- splits a live message. An entry is only cut in two when it would grow past an eighth of
-- the byte cap (the trim's slack), so trimming whole entries never has to drop the round
-- it just wrote unless one event alone is that large.
-- The owning worker fences every call on its owner generation: a worker that lost the
-- session (declared dead, the session re-placed) is refused before anything is written.
-- With a checkpoint, the same call stores it after the events, so the checkpoint always
-- matches the journal up to the last event of the call (a failover restores both at once).
-- A model-native session's model history grows in the same fenced calls: append-only,
-- about once a second, never rewritten whole.
-- Commands: one HMGET of the meta hash, one XADD per call with a journaled event, one HSET
-- of the counters, one (S)PUBLISH per frame (one per call unless an unjournaled event
-- splits it).
-- The journal's TTL is refreshed only when due: it is set to 1.5x ttl_ms and renewed once
-- less than ttl_ms of it is left (by the caller's clock, stored as journal_expires_at), so
-- the journal still lives at least ttl_ms past its last write. A refresh that finds the
-- journal gone (expired) resets its byte count and first seq, so the accounting stays
-- exact. journal_bytes is the sum of the entries' data lengths; over the byte cap, the
-- oldest whole entries are trimmed in bulk (XLEN + XRANGE COUNT n + XDEL) down to the
-- low-water mark, 7/8 of the cap, so trims come far apart; journal_first_seq is then the
-- first seq of the oldest entry kept. One record larger than the whole cap makes replay
-- impossible: the journal is dropped and journal_overflow set, for good.
-- KEYS[1] duplex:session:{SID}              meta hash
-- KEYS[2] duplex:session:{SID}:events       journal stream
-- KEYS[3] duplex:session:{SID}:checkpoint   string: the session's checkpoint JSON
-- KEYS[4] duplex:session:{SID}:model        string: a model-native session's model history
-- ARGV[1] live channel   ARGV[2] journal max bytes   ARGV[3] journal TTL (ms)
-- ARGV[4] now (ms)       ARGV[5] closed-session key TTL (ms)
-- ARGV[6] an event id for the session.resync_required notice, should the journal overflow
-- ARGV[7] the caller's owner generation ("": not an owner; the janitor and operators)
-- ARGV[8] a checkpoint JSON to store after the events ("": none)
-- ARGV[9] "1": stamp server_event_seq on the JSON (duplex surface), "0": do not (openai)
-- ARGV[10] "1": SPUBLISH (Redis Cluster: the channel hashes to the session's slot), "0": PUBLISH
-- ARGV[11] the byte offset of ARGV[12] in the model history ("": nothing to append)
-- ARGV[12] the model history's bytes from that offset (its frames' records since the last
--   write). Written with SETRANGE, so a call retried after a reply that never came writes
--   the same bytes again; an offset past the end (the key lost bytes) writes nothing and
--   sets model_gap, and the length returned tells the writer where to write from again.
-- ARGV[13] the model's record bytes per frame (kept as model_record_bytes, for operators)
-- ARGV[14] the writer's seq floor: the highest seq it was handed for the session (0: none).
--   A next_seq below it means the store went back in time (a failover promoted a replica
--   that had not received the last writes): next_seq moves up to the floor, so no seq a
--   client may hold is handed out again, and the journal starts over after it (what is
--   left of it cannot be replayed to a client past the gap: such a client resyncs);
--   seq_regressions counts it for operators
-- ARGV[15] the caller's worker id ("": not a worker). The fence on ARGV[7] refuses an
--   owner generation below the stored one; one above it means the store lost the move
--   that made the caller the owner (a failover lost it): the move stands (the caller holds
--   the session, its old owner has stopped or died), so owner_generation and worker are
--   set back to the caller's, and every later write of the old owner is refused
-- ARGV[16] the round's token ("": none). A call sent again with the token of the session's
--   last written call (its reply was lost: a connection dropped, a master failing over,
--   a client library retrying) writes nothing and returns that call's reply, kept as
--   last_round / last_round_reply, so no event is journaled or published twice
-- then per event, 5 values: journaled ("1"/"0"), type, event JSON (compact, ends in "}"),
--   session object JSON ("" unless the event carries the session: created/updated),
--   response id ("" when none; no line break)
-- returns one seq per event (0 = not journaled), then, when the call appended to the model
--         history, the history's length after it; {-1} when the session is gone;
--         {-2} when the caller is not the session's owner (nothing written)
local meta, journal, checkpoint, model = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local channel, max_bytes, ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now, stamp = tonumber(ARGV[4]), ARGV[9] == '1'
local publish = ARGV[10] == '1' and 'SPUBLISH' or 'PUBLISH'
local m = redis.call('HMGET', meta, 'state', 'owner_generation', 'journal_overflow',
  'next_seq', 'journal_bytes', 'journal_first_seq', 'journal_expires_at', 'checkpoints',
  'seq_regressions', 'last_round', 'last_round_reply', 'worker', 'owner_regressions')
local state = m[1]
if not state then
  return {-1}
end
-- a call sent again under the token of the last written one (its reply was lost): its
-- reply, whatever happened since (a move after it does not undo what it wrote)
local token = ARGV[16]
if token ~= '' and m[10] == token then
  local reply = {}
  for value in string.gmatch(m[11] or '', '[^,]+') do
    reply[#reply + 1] = tonumber(value)
  end
  return reply
end
local updates = {}  -- the meta fields this call changes: one HSET at the end
if ARGV[7] ~= '' then
  local stored, mine = tonumber(m[2]) or 0, tonumber(ARGV[7])
  if stored > mine then
    return {-2}
  elseif stored == mine then
    -- the same generation held by another worker: a move the store lost handed its
    -- number out again (a second move from the old owner); the store's owner keeps it
    if ARGV[15] ~= '' and m[12] and m[12] ~= ARGV[15] then
      return {-2}
    end
  else
    if ARGV[15] == '' then
      return {-2}
    end
    updates['owner_generation'], updates['worker'] = ARGV[7], ARGV[15]
    updates['owner_regressions'] = (tonumber(m[13]) or 0) + 1
  end
end
local overflow = m[3] == '1'
local next_seq = tonumber(m[4]) or 0
local bytes = tonumber(m[5]) or 0
local first_seq = tonumber(m[6]) or 1
local expires_at = tonumber(m[7]) or 0
local entry_cap = math.max(math.floor(max_bytes / 8), 1)
local frame = {}    -- framed records not yet published
local entry = {}    -- journaled records not yet in the journal
local entry_first, entry_last, entry_bytes = 0, 0, 0
local seqs = {}
local opened, recreated, closed_now = false, false, false

local floor = tonumber(ARGV[14]) or 0
if floor > next_seq then
  next_seq = floor
  updates['next_seq'] = floor
  updates['seq_regressions'] = (tonumber(m[9]) or 0) + 1
  if not overflow then
    redis.call('DEL', journal)
    bytes, first_seq, expires_at = 0, floor + 1, 0
    updates['journal_first_seq'] = first_seq
  end
end

local function flush()
  if #frame > 0 then
    redis.call(publish, channel, table.concat(frame))
    frame = {}
  end
end

local function write_entry()
  if #entry > 0 then
    local data = table.concat(entry)
    redis.call('XADD', journal, entry_first .. '-1', 'last', entry_last, 'data', data)
    bytes = bytes + #data
    entry, entry_bytes = {}, 0
  end
end

-- before the call's first XADD: renew the journal's TTL if due; a journal found gone
-- (expired) had nothing left: its byte count and first seq start over
local function open_journal()
  opened = true
  if state == 'closed' or (expires_at - now >= ttl_ms and bytes > 0) then
    return
  end
  if redis.call('PEXPIRE', journal, ttl_ms + math.floor(ttl_ms / 2)) == 0 then
    recreated = true  -- the XADD creates it: its TTL is set after the events
    bytes, first_seq = 0, next_seq + 1
    updates['journal_first_seq'] = first_seq
  end
  updates['journal_expires_at'] = now + ttl_ms + math.floor(ttl_ms / 2)
end

for i = 17, #ARGV, 5 do
  local journaled, etype, data, session, rid = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  if session ~= '' then
    updates['session'] = session
  end
  if etype == 'session.created' then
    state = 'active'
    updates['state'] = state
  end
  local seq = 0
  local out = data
  local record
  if journaled == '1' and not overflow then
    if not opened then
      open_journal()
    end
    next_seq = next_seq + 1
    seq = next_seq
    updates['next_seq'] = next_seq
    -- a JSON object only: a record of bytes (a moshi session's audio) is never stamped
    if stamp and string.byte(data, -1) == 125 then
      out = string.sub(data, 1, -2) .. ',"server_event_seq":' .. seq .. '}'
    end
    record = seq .. ' ' .. #out .. ' ' .. etype .. ' ' .. rid .. '\n' .. out
    if #record > max_bytes then
      -- one event larger than the whole journal: replay is impossible from now on (sticky)
      overflow = true
      bytes = 0
      entry, entry_bytes = {}, 0
      updates['journal_overflow'] = 1
      redis.call('DEL', journal)
      flush()
      redis.call(publish, channel, '{"type":"session.resync_required","event_id":"' ..
        ARGV[6] .. '","session_id":"' .. string.match(meta, '{(.-)}') ..
        '","reason":"journal_overflow"}')
      seq = 0
      out = data
      record = nil
    else
      if entry_bytes > 0 and entry_bytes + #record > entry_cap then
        write_entry()  -- a round too large for one entry: the trim stays whole-entry exact
      end
      if #entry == 0 then
        entry_first = seq
      end
      entry_last = seq
      entry[#entry + 1] = record
      entry_bytes = entry_bytes + #record
    end
  end
  if etype == 'session.closed' then
    redis.call('DEL', checkpoint, model)  -- nothing restores a closed session
    state = 'closed'
    updates['state'], updates['closed_at'] = state, ARGV[4]
    closed_now = true  -- the keys' short TTL is set once the journal entry is written
  end
  if journaled == '1' then
    frame[#frame + 1] = record or ('0 ' .. #out .. ' ' .. etype .. ' ' .. rid .. '\n' .. out)
  else
    flush()  -- an unjournaled event goes alone, as bare JSON, in its place in the order
    redis.call(publish, channel, out)
  end
  seqs[#seqs + 1] = seq
end
write_entry()
flush()
if closed_now then
  redis.call('PEXPIRE', meta, tonumber(ARGV[5]))
  redis.call('PEXPIRE', journal, tonumber(ARGV[5]))
end

if opened and not overflow then
  if bytes > max_bytes then
    -- oldest whole entries first, down to the low-water mark; the count asked of XRANGE
    -- is estimated from the mean entry size (a second round if the oldest were small)
    local low_water = max_bytes - math.floor(max_bytes / 8)
    local entries = math.max(redis.call('XLEN', journal), 1)
    while bytes > low_water do
      local want = math.min(math.ceil((bytes - low_water) * entries / bytes) + 1, 1000)
      local oldest = redis.call('XRANGE', journal, '-', '+', 'COUNT', want)
      if #oldest == 0 then
        bytes = 0  -- an empty journal holds no bytes, whatever the count said
        first_seq = next_seq + 1
        break
      end
      local doomed = {}
      for _, old in ipairs(oldest) do
        if bytes <= low_water then
          break
        end
        local fields = old[2]
        doomed[#doomed + 1] = old[1]
        bytes = bytes - #fields[4]  -- data is the second field in both entry shapes
        -- an entry of an older worker holds one event: its id is its seq
        first_seq = (fields[1] == 'last' and tonumber(fields[2])
          or tonumber(string.match(old[1], '^(%d+)'))) + 1
      end
      redis.call('XDEL', journal, unpack(doomed))
      entries = math.max(entries - #doomed, 1)
    end
    updates['journal_first_seq'] = first_seq
  end
  if recreated and state ~= 'closed' then
    redis.call('PEXPIRE', journal, ttl_ms + math.floor(ttl_ms / 2))
  end
end
if bytes ~= (tonumber(m[5]) or 0) then
  updates['journal_bytes'] = bytes
end

if ARGV[8] ~= '' and state ~= 'closed' then
  redis.call('SET', checkpoint, ARGV[8])
  updates['checkpoints'] = (tonumber(m[8]) or 0) + 1
end
local model_length = nil
if ARGV[11] ~= '' and state ~= 'closed' then
  local offset = tonumber(ARGV[11])
  model_length = redis.call('STRLEN', model)
  if model_length >= offset then
    model_length = redis.call('SETRANGE', model, offset, ARGV[12])
    updates['model_bytes'] = model_length
    updates['model_record_bytes'] = ARGV[13]
  else
    updates['model_gap'] = offset
  end
end
if model_length then
  seqs[#seqs + 1] = model_length  -- the writer resumes from here after a gap
end
if token ~= '' then
  updates['last_round'], updates['last_round_reply'] = token, table.concat(seqs, ',')
end
local fields = {}
for field, value in pairs(updates) do
  fields[#fields + 1] = field
  fields[#fields + 1] = value
end
if #fields > 0 then
  redis.call('HSET', meta, unpack(fields))
end
return seqs
