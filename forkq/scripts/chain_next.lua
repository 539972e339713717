-- A chained step succeeded: push the chain's next step (or park its continuation in dead)
-- and release the step's in-flight entry, in one call, with its after-success actions.
-- KEYS[1] the in-flight hash, KEYS[2] forkq's queues set ('push') or dead ('dead'),
-- KEYS[3] the next step's queue list ('push'; anything in 'dead'), KEYS[4] a stored
-- chain's list of steps (chains.py), if it has one
-- ARGV[1] the step's token, ARGV[2] 'push' or 'dead', ARGV[3] the queue's name ('push') or
-- now ('dead'), ARGV[4] the payload, ARGV[5] dead's cutoff score, ARGV[6] dead_max_jobs,
-- ARGV[7] what to do with KEYS[4]: 'keep' (renew its expiry, ARGV[8] ms: its steps may
-- still be pushed, from dead too), 'del' (its last step is pushed) or '' (none),
-- then (key, jid) pairs (_after.lua): a unique job's lock, a batch to count the step in.
-- Returns 1 when done; 0, writing nothing, when the step's entry is no longer in flight
-- (this call repeated after its reply was lost, or the job put back by a recovery, so it
-- runs again and pushes then): a next step is pushed once per entry, never twice; the
-- type of what the queue's key holds ('string', 'hash'...), writing nothing, when it is
-- not a list.
local function after_success(args, first, last)
--#include batch
--#include after
end
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  return 0
end
if ARGV[2] == 'push' then
  local kind = redis.call('TYPE', KEYS[3])['ok']
  if kind ~= 'list' and kind ~= 'none' then
    return kind
  end
  redis.call('LPUSH', KEYS[3], ARGV[4])
  redis.call('SADD', KEYS[2], ARGV[3])
else
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
  -- Sidekiq's trimming, as to_dead.lua does it
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[5])
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[6]))
end
if ARGV[7] == 'keep' then
  redis.call('PEXPIRE', KEYS[4], ARGV[8])
elseif ARGV[7] == 'del' then
  redis.call('DEL', KEYS[4])
end
redis.call('HDEL', KEYS[1], ARGV[1])
after_success(ARGV, 9, #ARGV)
return 1
