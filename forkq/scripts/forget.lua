-- Remove entries an operator deletes (forkq dead/queues, forkq.api, the dashboard), and
-- release the unique lock of each one this call removed, while it still holds the jid.
-- A lock is released only for an entry this call took out: one another process moved
-- meanwhile (the scheduler, a worker's claim) is still a pending job that holds it.
-- KEYS[1] the sorted set or the queue list
-- ARGV[1] 'zset' or 'list', then (member, lock key or '', jid) triplets
-- Returns how many entries were removed.
local removed = 0
local zset = ARGV[1] == 'zset'
for i = 2, #ARGV, 3 do
  local n
  if zset then
    n = redis.call('ZREM', KEYS[1], ARGV[i])
  else
    n = redis.call('LREM', KEYS[1], 1, ARGV[i])
  end
  if n > 0 then
    removed = removed + n
    local lock = ARGV[i + 1]
    if lock ~= '' and redis.call('GET', lock) == ARGV[i + 2] then
      redis.call('DEL', lock)
    end
  end
end
return removed
