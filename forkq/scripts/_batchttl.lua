-- A batch's keys' lives: forkq.batch.TTL_S and DONE_TTL_S (a test holds them equal), set
-- by batch_expire. A batch with a job due later (a scheduled push keeps the latest due
-- time in the hash's `horizon`) keeps its keys TTL_S past that time: expired before it,
-- they would leave the job nothing to count in, and the batch would never fire.
local BATCH_TTL = 2592000
local BATCH_DONE_TTL = 86400

local function batch_expire(b, ttl)
  if ttl == BATCH_TTL then
    local horizon = tonumber(redis.call('HGET', b, 'horizon'))
    if horizon then
      local later = math.ceil(horizon - tonumber(redis.call('TIME')[1])) + BATCH_TTL
      if later > ttl then
        ttl = later
      end
    end
  end
  redis.call('EXPIRE', b, ttl)
  redis.call('EXPIRE', b .. ':jids', ttl)
  redis.call('EXPIRE', b .. ':failed', ttl)
end
