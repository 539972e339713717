-- An iterable job interrupted by its worker's stop (forkq/iterate.py): write its
-- checkpoint, put it back at the head of its queue and delete its in-flight entry, in one
-- call, so that a stop (or a crash) right then neither loses the job nor runs it twice.
-- Not counted as a failure: its payload goes back as fetched, less its expires_at and with
-- a new enqueued_at (iterate.requeued).
-- A job that has a crash count (a suspect cut off by a stop) goes back at the head of its
-- queue's suspects list, as the final requeue (requeue_all.lua) would send it.
-- KEYS[1] the in-flight hash, KEYS[2] the checkpoint key (forkq:iter:JID)
-- ARGV[1] the job's in-flight field, ARGV[2] the checkpoint's JSON ('' when the runner
-- wrote it already, before closing the generator: the one there stays), ARGV[3] its TTL
-- in seconds, ARGV[4] crash-count key prefix, ARGV[5] suspects-list key prefix, ARGV[6]
-- the payload to put back instead of the one fetched ('' for that one): without its
-- expires_at and enqueued_at now (iterate.requeued)
-- Returns 1 if the job was put back, 0 if its entry was gone (put back by someone else
-- already: pushing it again would run it twice) or in no known form (left for the final
-- requeue, which sends it to dead).
--#include entry
if ARGV[2] ~= '' then
  redis.call('SET', KEYS[2], ARGV[2], 'EX', tonumber(ARGV[3]))
end
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then
  return 0
end
local name, job = entry(ARGV[1], v)
if not name then
  return 0
end
local id = crash_id(job)
if ARGV[6] ~= '' then
  job = ARGV[6]
end
if id and redis.call('EXISTS', ARGV[4] .. id) == 1 then
  redis.call('RPUSH', ARGV[5] .. name, job)
else
  redis.call('RPUSH', 'queue:' .. name, job)
end
keep_listed(name)
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
