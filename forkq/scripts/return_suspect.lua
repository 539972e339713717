-- Put a claimed suspect that no thread started back at the head of its queue's suspects
-- list (a stop came between its claim and its start). Its crash count stays: it is still a
-- suspect.
--
-- KEYS[1] the in-flight hash; ARGV[1] the claim's field, ARGV[2] the suspects-list key prefix
-- Returns 1 if it was put back, 0 if it was not in flight.
--#include entry
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then
  return 0
end
local name, job = entry(ARGV[1], v)
if name then
  redis.call('RPUSH', ARGV[2] .. name, job)
  keep_listed(name)
else
  -- no queue to put it back on: left in flight it would run again at every restart
  malformed_to_dead(v, 'in-flight entry of unknown form (field ' .. ARGV[1] .. ')', 1)
end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
