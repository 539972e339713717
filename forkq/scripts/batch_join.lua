-- Count jobs pushed into a batch: queued in the MULTI that pushes them (Batch.registered),
-- so there is never a job without its count nor a count without its job.
-- KEYS[1] the batch hash, KEYS[2] its :jids set
-- ARGV[1] '' or, for a scheduled push, its due time (epoch seconds), ARGV[2..] the jids
-- The keys' lives follow the latest due time (_batchttl.lua): a plain EXPIRE here would
-- cut short what an earlier push further out had set.
--#include batchttl
for i = 2, #ARGV, 1000 do
  redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('HINCRBY', KEYS[1], 'total', #ARGV - 1)
if ARGV[1] ~= '' and tonumber(ARGV[1]) > (tonumber(redis.call('HGET', KEYS[1], 'horizon')) or 0) then
  redis.call('HSET', KEYS[1], 'horizon', ARGV[1])
end
batch_expire(KEYS[1], BATCH_TTL)
return #ARGV - 1
