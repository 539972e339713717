-- Take a lease on a concurrent limiter if it has a free slot: one call per attempt.
-- KEYS[1] the limiter's zset forkq:limiter:NAME:concurrent, member = a lease's token,
--   score = when the lease lapses (Redis's clock, epoch ms)
-- ARGV[1] size, ARGV[2] lease ms (lock_timeout), ARGV[3] this lease's token
-- Returns {1, holders} when the lease was taken, {0, holders, ms until the earliest lease
-- lapses} when the limiter is full.
-- Redis's clock, not the caller's: hosts drift, and a lease stamped by a host running
-- ahead would outlive its lock_timeout for everyone else.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key = KEYS[1]
-- the slots of holders that never released (a SIGKILLed child) come back here
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local held = redis.call('ZCARD', key)
if held >= tonumber(ARGV[1]) then
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  return {0, held, tonumber(first[2]) - now}
end
local lease = tonumber(ARGV[2])
redis.call('ZADD', key, now + lease, ARGV[3])
-- the key goes once its last lease could have lapsed, so an unused limiter leaves nothing
if redis.call('PTTL', key) < lease then
  redis.call('PEXPIRE', key, lease)
end
return {1, held + 1}
