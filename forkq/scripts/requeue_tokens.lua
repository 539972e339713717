-- Put chosen in-flight jobs back at the head of their queues (a graceful stop or quiet
-- returning jobs that were claimed but never started).
-- KEYS[1] the in-flight hash; ARGV its fields, oldest claim first.
--#include entry
local n = 0
for i = #ARGV, 1, -1 do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    local name, job = entry(ARGV[i], v)
    if name then
      redis.call('RPUSH', 'queue:' .. name, job)
      keep_listed(name)
      redis.call('HDEL', KEYS[1], ARGV[i])
      n = n + 1
    end
    -- an entry in no known form stays: the process's final requeue sends it to dead
  end
end
return n
