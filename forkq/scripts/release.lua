-- Acknowledge in-flight entries and release unique locks in one call.
-- KEYS[1] the in-flight hash
-- ARGV[1] n, then n hash fields to delete, then (lock key, jid) pairs
-- A lock is deleted only while it holds that jid: one that expired and was taken again by a
-- newer push belongs to that push.
--#include unlock
local n = tonumber(ARGV[1])
if n > 0 then
  redis.call('HDEL', KEYS[1], unpack(ARGV, 2, 1 + n))
end
unlock(ARGV, n + 2, #ARGV)
return n
