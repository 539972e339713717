-- Put chosen in-flight jobs back at the head of their queues (a graceful stop or quiet
-- returning jobs that were claimed but never started).
-- KEYS[1] the in-flight hash; ARGV tokens, oldest first.
local n = 0
for i = #ARGV, 1, -1 do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    local cut = string.find(v, "\n", 1, true)
    redis.call('RPUSH', 'queue:' .. string.sub(v, 1, cut - 1), string.sub(v, cut + 1))
    redis.call('HDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return n
