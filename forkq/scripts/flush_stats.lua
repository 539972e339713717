-- Bring stat:processed and stat:failed (and today's per-day keys) up to a process's running
-- totals. KEYS[1] holds the totals already added for that process; only what goes beyond
-- them is added, so the same totals sent twice, or an older figure landing after a newer
-- one, add nothing. Both writers use it: the process's own heartbeat, and its master after
-- the process died with jobs it had not flushed (it learned their totals from the pings).
-- A heartbeat the process sent just before it died travels on another connection than the
-- master's and may reach Redis after the master's call: both add only beyond KEYS[1], so
-- the jobs are still counted once.
--
-- KEYS[1] the totals-flushed hash {processed, failed}, KEYS[2] stat:processed,
-- KEYS[3] stat:failed, KEYS[4] stat:processed:DAY, KEYS[5] stat:failed:DAY
-- ARGV[1] processed, ARGV[2] failed: the running totals (since the process started)
-- ARGV[3], ARGV[4]: what the caller knows it flushed, taken when KEYS[1] is missing (the
-- process's first beat, or the key expired); empty: when KEYS[1] is missing add nothing
-- (the master cannot know what a process whose key expired had flushed)
-- ARGV[5] KEYS[1]'s expiry, ARGV[6] the per-day keys' expiry, in seconds
-- Returns {processed added, failed added}.
local stored = redis.call('HMGET', KEYS[1], 'processed', 'failed')
if not stored[1] and ARGV[3] == '' then
  return {0, 0}
end
local added = {0, 0}
local keep = {}
for i = 1, 2 do
  local new = tonumber(ARGV[i])
  local old = tonumber(stored[i]) or tonumber(ARGV[i + 2])
  if new > old then
    added[i] = new - old
    redis.call('INCRBY', KEYS[i + 1], added[i])
    redis.call('INCRBY', KEYS[i + 3], added[i])
    redis.call('EXPIRE', KEYS[i + 3], ARGV[6])
    old = new
  end
  keep[i] = old
end
-- written even when nothing was added: from a process's first beat on, its master finds
-- here what the process flushed
redis.call('HSET', KEYS[1], 'processed', keep[1], 'failed', keep[2])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return added
