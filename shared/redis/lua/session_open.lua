-- session_open.lua: create a session's meta hash (state "opening") and an empty journal.
-- KEYS[1] duplex:session:{SID}          meta hash
-- KEYS[2] duplex:session:{SID}:events   journal stream
-- KEYS[3] duplex:session:{SID}:checkpoint  (a stale one is removed)
-- KEYS[4] duplex:session:{SID}:model       (a stale model history too)
-- The opening worker is the session's first owner: owner generation 1.
-- ARGV[1] worker id   ARGV[2] model   ARGV[3] resume token SHA-256 (hex, "" = not resumable)
-- ARGV[4] now (ms)    ARGV[5] session config JSON   ARGV[6] the API pod attaching it
-- ARGV[7] SHA-256 of the API key that opened it ("" when the deployment has no keys):
--         only the same key may resume it (lease_resume.lua)
-- returns 1, or an error reply "session_exists"
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('session_exists')
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
redis.call('HSET', KEYS[1],
  'state', 'opening', 'worker', ARGV[1], 'model', ARGV[2],
  'created_at', ARGV[4], 'last_activity', ARGV[4],
  'lease_generation', 0, 'attachment_generation', 1, 'owner_generation', 1,
  'resume_token_sha256', ARGV[3], 'previous_token_sha256', '',
  'next_seq', 0, 'journal_first_seq', 1, 'journal_bytes', 0, 'journal_overflow', 0,
  'config', ARGV[5], 'pod', ARGV[6], 'key_sha256', ARGV[7] or '')
return 1
