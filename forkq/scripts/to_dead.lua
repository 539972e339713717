-- Move one entry to the dead set, trimming it as Sidekiq does, and release where it was.
-- KEYS[1] dead, KEYS[2] source (in-flight hash or sorted set)
-- ARGV[1] payload for dead, ARGV[2] now, ARGV[3] hash field or zset member to remove,
-- ARGV[4] 'hash' or 'zset', ARGV[5] cutoff score, ARGV[6] Sidekiq's dead_max_jobs,
-- then optionally ARGV[7] a unique job's lock key ('' for none) and ARGV[8] its jid:
-- released if it still holds that jid; then optionally ARGV[9] its batch key and ARGV[10]
-- its failure (JSON), counted in the batch (an operator's kill of a job that never failed,
-- from the schedule: a job in dead has ended, and uncounted its batch never completed)
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
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
if ARGV[7] and ARGV[7] ~= '' then
  unlock(ARGV, 7, 8)
end
if ARGV[9] then
  batch_failure(ARGV[9], ARGV[8], ARGV[10])
end
-- Sidekiq's own calls: the cutoff inclusive, and rank -max, which keeps max - 1 entries
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[5])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[6]))
if ARGV[4] == 'hash' then
  return redis.call('HDEL', KEYS[2], ARGV[3])
end
return removed
