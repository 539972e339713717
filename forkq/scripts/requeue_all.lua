-- Return everything a process held (landing lists and in-flight hash) to the head of the
-- queues it came from, then forget the process. Used by a worker at its own stop, by the
-- supervisor after a child died, and by orphan recovery.
--
-- KEYS[1] in-flight hash, KEYS[2] owners registry, KEYS[3..] landing lists
-- ARGV[1] identity, ARGV[2] crashed (1: count each in-flight job as a suspect in the death)
-- ARGV[3] crashes that make a job poison, ARGV[4] now, ARGV[5] crash-count key prefix
-- ARGV[6..] the queue name of each landing list
-- Returns {requeued, poisoned}.
local requeued, poisoned = 0, 0
for i = 3, #KEYS do
  local name = ARGV[i + 3]
  -- landing lists are LPUSHed, so pushing them in LRANGE order leaves the oldest rightmost
  local jobs = redis.call('LRANGE', KEYS[i], 0, -1)
  for _, job in ipairs(jobs) do
    redis.call('RPUSH', 'queue:' .. name, job)
    requeued = requeued + 1
  end
  redis.call('DEL', KEYS[i])
end

local flat = redis.call('HGETALL', KEYS[1])
local items = {}
for i = 1, #flat, 2 do
  items[#items + 1] = {tonumber(flat[i]) or 0, flat[i + 1]}
end
-- newest first, so the oldest claim ends rightmost: first in line again
table.sort(items, function(a, b) return a[1] > b[1] end)
local crashed = ARGV[2] == '1'
local limit = tonumber(ARGV[3])
for _, item in ipairs(items) do
  local v = item[2]
  local cut = string.find(v, "\n", 1, true)
  local name, job = string.sub(v, 1, cut - 1), string.sub(v, cut + 1)
  local dead = false
  if crashed then
    local ok, decoded = pcall(cjson.decode, job)
    if ok and type(decoded) == 'table' and type(decoded['jid']) == 'string' then
      local key = ARGV[5] .. decoded['jid']
      local count = redis.call('INCR', key)
      redis.call('EXPIRE', key, 86400)
      if count >= limit then
        dead = true
        decoded['error_class'] = 'forkq.PoisonJob'
        decoded['error_message'] = 'killed its worker process ' .. count .. ' times'
        decoded['failed_at'] = tonumber(ARGV[4])
        -- cjson re-encodes the payload; the original is kept in a field so nothing is lost
        decoded['forkq_original'] = job
        redis.call('ZADD', 'dead', ARGV[4], cjson.encode(decoded))
        redis.call('DEL', key)
        poisoned = poisoned + 1
      end
    end
  end
  if not dead then
    redis.call('RPUSH', 'queue:' .. name, job)
    requeued = requeued + 1
  end
end
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return {requeued, poisoned}
