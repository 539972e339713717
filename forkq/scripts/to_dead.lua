-- Move one entry to the dead set, trimming it as Sidekiq does, and release where it was.
-- KEYS[1] dead, KEYS[2] source (in-flight hash, sorted set or queue list), then for an
-- operator's cancel (cancel.py) KEYS[3] forkq:cancel and optionally KEYS[4] the job's
-- keep_result key
-- ARGV[1] payload for dead, ARGV[2] now, ARGV[3] hash field, or zset member or list entry
-- to remove, ARGV[4] 'hash', 'zset' or 'list', ARGV[5] cutoff score, ARGV[6] Sidekiq's
-- dead_max_jobs,
-- then optionally ARGV[7] a unique job's lock key ('' for none) and ARGV[8] its jid:
-- released if it still holds that jid; then optionally ARGV[9] its batch key and ARGV[10]
-- its failure (JSON), counted in the batch (an operator's kill of a job that never failed,
-- from the schedule: a job in dead has ended, and uncounted its batch never completed;
-- '' for none); with KEYS[3], ARGV[8] is the jid whose cancel request goes in this call,
-- and with KEYS[4], ARGV[11] the result element and ARGV[12] its TTL in ms
-- Returns how many entries left the source (0 or 1).
--#include unlock
--#include batch
local removed
if ARGV[4] == 'zset' then
  -- an entry another process moved or deleted since it was read (the scheduler, a second
  -- scheduler, an operator) is not copied into dead, nor its job's lock released: the job
  -- may be pending on its queue
  removed = redis.call('ZREM', KEYS[2], ARGV[3])
  if removed == 0 then
    return 0
  end
elseif ARGV[4] == 'list' then
  -- exact bytes, one copy (equal bytes are the same job pushed twice); gone means a worker
  -- claimed it or an operator moved it meanwhile: nothing is written, the request stays
  removed = redis.call('LREM', KEYS[2], 1, ARGV[3])
  if removed == 0 then
    return 0
  end
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if ARGV[7] and ARGV[7] ~= '' then
  unlock(ARGV, 7, 8)
end
if ARGV[9] and ARGV[9] ~= '' then
  batch_failure(ARGV[9], ARGV[8], ARGV[10])
end
if KEYS[3] then
  redis.call('HDEL', KEYS[3], ARGV[8])
end
if KEYS[4] then
  -- as results.queue_write: the list replaced whole, with its TTL
  redis.call('DEL', KEYS[4])
  redis.call('RPUSH', KEYS[4], ARGV[11])
  redis.call('PEXPIRE', KEYS[4], ARGV[12])
end
-- Sidekiq's own calls: the cutoff inclusive, and rank -max, which keeps max - 1 entries
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[5])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[6]))
if ARGV[4] == 'hash' then
  return redis.call('HDEL', KEYS[2], ARGV[3])
end
return removed
