-- Seal a batch: no job joins it any more, its callbacks are stored, and whatever is due
-- already fires (all of an empty batch's, or those of jobs that all ended before sealing).
-- KEYS[1] the batch hash
-- ARGV[1] on_success payload ('' for none), ARGV[2] its queue, ARGV[3] on_complete
-- payload ('' for none), ARGV[4] its queue
-- Reply: 1 sealed now, 0 sealed before, -1 no such batch (never opened, or expired).
--#include batch
local b = KEYS[1]
if redis.call('EXISTS', b) == 0 then
  return -1
end
if redis.call('HGET', b, 'sealed') == '1' then
  return 0
end
redis.call('HSET', b, 'sealed', '1')
if ARGV[1] ~= '' then
  redis.call('HSET', b, 'on_success', ARGV[1], 'on_success_queue', ARGV[2])
end
if ARGV[3] ~= '' then
  redis.call('HSET', b, 'on_complete', ARGV[3], 'on_complete_queue', ARGV[4])
end
batch_expire(b, BATCH_TTL)
batch_check(b)
return 1
