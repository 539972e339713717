-- Put a claimed suspect that no thread started back at the head of the suspects list (a
-- stop came between its claim and its start). Its crash count stays: it is still a suspect.
--
-- KEYS[1] the in-flight hash, KEYS[2] the suspects list; ARGV[1] the claim's token
-- Returns 1 if it was put back, 0 if it was not in flight.
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then
  return 0
end
redis.call('RPUSH', KEYS[2], v)
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
