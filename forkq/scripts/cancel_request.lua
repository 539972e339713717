-- Write a cancellation request (cancel.py), the first one's by/reason standing, and prune
-- requests older than a day from a small random sample: the hash cannot grow for ever
-- from requests nobody deleted (a cancel left pending for a job that never ran again),
-- and no call does more than a sample's work.
-- KEYS[1] forkq:cancel, ARGV[1] jid, ARGV[2] the request (JSON), ARGV[3] the cutoff (epoch
-- seconds), ARGV[4] the sample size
-- Returns {1 if this call wrote it else 0, the request that stands, pruned}
local wrote = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
local pruned = 0
local cutoff = tonumber(ARGV[3])
local sample = redis.call('HRANDFIELD', KEYS[1], tonumber(ARGV[4]), 'WITHVALUES')
for i = 1, #sample, 2 do
  if sample[i] ~= ARGV[1] then
    local ok, req = pcall(cjson.decode, sample[i + 1])
    local at = ok and type(req) == 'table' and tonumber(req['at'])
    -- one written by hand with no usable time is left alone: the worker reads it all the same
    if at and at < cutoff then
      pruned = pruned + redis.call('HDEL', KEYS[1], sample[i])
    end
  end
end
return {wrote, redis.call('HGET', KEYS[1], ARGV[1]), pruned}
