-- Open a batch: its hash, and its entry in the index that lists batches (keys.BATCHES,
-- bid -> created_at), in one call, so no batch is left out of the index nor an entry
-- made for none. The index is pruned here, as batches are opened, so it needs no sweeper:
--  * an entry older than BATCH_TTL may name a batch whose keys expired, or not (a batch
--    lives BATCH_TTL past its latest job's end, or due time): PRUNE of these, from a rank
--    the caller draws at random (ARGV[5], in [0, 1)), are looked at, and those whose hash
--    is gone leave. Always the PRUNE oldest would stall behind PRUNE batches still alive
--    (jobs retrying for weeks keep theirs). A few each time keeps the call short however
--    the index grows; forkq.batch.recent drops the expired entries it reads too.
--  * past ARGV[4] entries the oldest leave, expired or not: the index's bound.
-- KEYS[1] the batch hash, KEYS[2] the index
-- ARGV[1] the bid, ARGV[2] its description, ARGV[3] created_at (epoch seconds),
-- ARGV[4] the most entries the index keeps, ARGV[5] a random number in [0, 1)
--#include batchttl
local PRUNE = 10
local b, index, bid = KEYS[1], KEYS[2], ARGV[1]
-- the index first: an index key of another type (WRONGTYPE) fails the call before it has
-- written anything (Redis keeps what a failed script wrote), and the `with` raises
redis.call('ZADD', index, ARGV[3], bid)
redis.call('HSET', b, 'description', ARGV[2], 'created_at', ARGV[3], 'sealed', '0')
redis.call('EXPIRE', b, BATCH_TTL)
local prefix = string.sub(b, 1, #b - #bid)
-- the old entries are the ranks below `older`, oldest first
local older = redis.call('ZCOUNT', index, '-inf', '(' .. (tonumber(ARGV[3]) - BATCH_TTL))
local from = 0
if older > PRUNE then
  from = math.floor(tonumber(ARGV[5]) * (older - PRUNE + 1))
end
local old = older > 0 and redis.call('ZRANGE', index, from, math.min(from + PRUNE, older) - 1) or {}
for _, other in ipairs(old) do
  if redis.call('EXISTS', prefix .. other) == 0 then
    redis.call('ZREM', index, other)
  end
end
redis.call('ZREMRANGEBYRANK', index, 0, -1 - tonumber(ARGV[4]))
return 1
