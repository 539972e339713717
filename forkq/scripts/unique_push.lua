-- Push jobs of which some are unique: each one's lock is taken and its job pushed together,
-- or neither. A lock held (by anyone) refuses its job, which pushes nothing.
-- KEYS[1] queues, KEYS[2] schedule
-- ARGV in groups of six per job: lock key ('' for a job without uniqueness), jid, lock TTL
-- in ms, queue, run-at score ('' to push onto the queue now), payload
-- Reply: 1 for each job pushed, 0 for each refused, in order.
--
-- The lock is written after the push: a Lua error stops a script where it is without
-- undoing what it wrote, and the push is what can fail (WRONGTYPE on a queue key; OOM
-- refuses a script before its first write). SET cannot fail on a key of any type, and
-- once a script has written Redis lets the rest of it write, so a job is never pushed
-- without its lock, and a lock never exists for a job that was not pushed.
local out = {}
local listed = {}  -- queues already SADDed by this call
for i = 1, #ARGV, 6 do
  local lock = ARGV[i]
  if lock ~= '' and redis.call('EXISTS', lock) == 1 then
    out[#out + 1] = 0
  else
    local q = ARGV[i + 3]
    if ARGV[i + 4] == '' then
      if not listed[q] then
        redis.call('SADD', KEYS[1], q)
        listed[q] = true
      end
      redis.call('LPUSH', 'queue:' .. q, ARGV[i + 5])
    else
      redis.call('ZADD', KEYS[2], ARGV[i + 4], ARGV[i + 5])
    end
    if lock ~= '' then
      redis.call('SET', lock, ARGV[i + 1], 'PX', ARGV[i + 2])
    end
    out[#out + 1] = 1
  end
end
return out
