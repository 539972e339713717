-- Put a claimed suspect that no thread started back at the head of the suspects list (a
-- stop came between its claim and its start). Its crash count stays: it is still a suspect.
--
-- KEYS[1] the in-flight hash, KEYS[2] the suspects list; ARGV[1] the claim's field
-- Returns 1 if it was put back, 0 if it was not in flight.
--#include entry
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then
  return 0
end
local name, job = entry(ARGV[1], v)
-- the suspects list holds "QUEUE\nPAYLOAD"; an entry in no known form goes as it is, and
-- claim_suspect sends it to dead with the reason
redis.call('RPUSH', KEYS[2], name and (name .. "\n" .. job) or v)
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
