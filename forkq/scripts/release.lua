-- Acknowledge in-flight entries and run after-success actions (_after.lua) in one call.
-- KEYS[1] the in-flight hash
-- ARGV[1] n, then n hash fields to delete, then (key, jid) pairs: a unique job's lock,
-- deleted only while it holds that jid (one that expired and was taken again by a newer
-- push belongs to that push), or a batch whose job succeeded
local function after_success(args, first, last)
--#include batch
--#include after
end
local n = tonumber(ARGV[1])
if n > 0 then
  redis.call('HDEL', KEYS[1], unpack(ARGV, 2, 1 + n))
end
after_success(ARGV, n + 2, #ARGV)
return n
