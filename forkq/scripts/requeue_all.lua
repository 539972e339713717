-- Return everything a process held (landing lists and in-flight hash) to the head of the
-- queues it came from, then forget the process (its registration and its heartbeat).
-- Used by a worker at its own stop, by the supervisor after a child died, and by orphan
-- recovery.
--
-- A job that was in flight in a process that crashed is a suspect: its crash count
-- (ARGV[5] .. its crash_id) goes up; at ARGV[3] it goes to dead as forkq.PoisonJob, otherwise it
-- goes onto its queue's suspects list (ARGV[6] .. queue), where workers of that queue take
-- suspects one at a time and run each alone, so that a later crash counts against that one
-- job only. A job put back without a crash that still has a crash count (a suspect cut off
-- by a stop) goes onto the suspects list too: back on its queue it would run beside others
-- again.
--
-- An iterable job (forkq/iterate.py) that checkpoints progress between its deaths is no
-- poison: each long run OOM-killed after hours of items resumes further on, which is what
-- such jobs are for. Its count counts the deaths since its checkpoint last moved: beside
-- the count, at (count key) .. ':cursor', is the SHA1 of the checkpoint's cursor as it was
-- at the last death counted; a death that finds another cursor starts the count again at
-- 1. A job with no checkpoint (any other job) costs one GET of a missing key per death.
--
-- An in-flight entry in no known form goes to dead with the reason.
--
-- KEYS[1] in-flight hash, KEYS[2] owners registry, KEYS[3..] landing lists
-- ARGV[1] identity, ARGV[2] crashed (1: count each in-flight job as a suspect in the death)
-- ARGV[3] crashes that make a job poison, ARGV[4] now, ARGV[5] crash-count key prefix,
-- ARGV[6] suspects-list key prefix, ARGV[7] '' or, for a stray (forkq/strays.py), the most
-- time (ms) its alive key may have left for the process to count as silent,
-- ARGV[8..] the queue name of each landing list
-- Returns {requeued, poisoned, suspects, leavers}: requeued counts every job put back to run
-- again, the suspects among them included; leavers are the dead entries of poisoned jobs
-- that hold a unique lock, keep a result or are in a batch, for the caller to release and
-- record (a lock's key is a SHA-256 that Lua cannot compute). {-1, 0, 0, {}} when a stray's process is
-- registered or has beaten since (it is alive: nothing is touched).
--#include entry
if ARGV[7] ~= '' then
  -- checked here, in the same call as the requeue: checked before it, a beat in between
  -- would re-register a live process that this call then unregisters and robs
  if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1
      or redis.call('PTTL', 'forkq:alive:' .. ARGV[1]) > tonumber(ARGV[7]) then
    return {-1, 0, 0, {}}
  end
end
local requeued, poisoned = 0, 0
local leavers = {}
local suspects = ARGV[6]
for i = 3, #KEYS do
  local name = ARGV[i + 5]
  -- landing lists are LPUSHed, so pushing them in LRANGE order leaves the oldest rightmost;
  -- nothing in them had started, so nothing in them is a suspect
  local jobs = redis.call('LRANGE', KEYS[i], 0, -1)
  for _, job in ipairs(jobs) do
    redis.call('RPUSH', 'queue:' .. name, job)
    requeued = requeued + 1
  end
  if #jobs > 0 then
    keep_listed(name)
  end
  redis.call('DEL', KEYS[i])
end

local flat = redis.call('HGETALL', KEYS[1])
local items = {}
for i = 1, #flat, 2 do
  items[#items + 1] = {claimed(flat[i]), flat[i], flat[i + 1]}
end
-- newest first, so the oldest claim ends rightmost: first in line again
table.sort(items, function(a, b) return a[1] > b[1] end)
local crashed = ARGV[2] == '1'
local limit = tonumber(ARGV[3])
local suspected = {}   -- crash suspects, newest first: {list, payload}
local held = 0         -- suspects put back without a crash
local malformed = 0
for _, item in ipairs(items) do
  local name, job = entry(item[2], item[3])
  if not name then
    malformed = malformed + 1
    malformed_to_dead(item[3], 'in-flight entry of unknown form (field ' .. item[2] .. ')', malformed)
  else
    local id, decoded = crash_id(job)
    local key = id and ARGV[5] .. id
    if crashed and key then
      local point = type(decoded['jid']) == 'string' and redis.call('GET', 'forkq:iter:' .. id)
      if point then
        -- the cursor's own text: iterate._dump writes {"cursor": C, "at": TIME}, and the
        -- time changes at every write, moved or not
        local mark = redis.sha1hex(string.match(point, '^{"cursor": (.*), "at": [-+.%deE]+}$') or point)
        if redis.call('GET', key .. ':cursor') ~= mark then
          redis.call('DEL', key)  -- it moved since the last death counted: count afresh
        end
        redis.call('SET', key .. ':cursor', mark, 'EX', 259200)
      end
      local count = redis.call('INCR', key)
      -- Sidekiq Pro's window: a job recovered --poison-after times in 72 hours is poison
      redis.call('EXPIRE', key, 259200)
      if count >= limit then
        -- The payload keeps its own text, with the reason appended: cjson would write an
        -- empty [] as {} (args, tags), round integers past 2^53 and cut floats to 14
        -- digits, and Sidekiq's "Retry" refuses (and drops) such an entry. A key the
        -- payload already has (error_class after an earlier failure) is written twice;
        -- JSON readers (Ruby's, Python's, orjson) keep the last. failed_at stays the first
        -- failure's, as Sidekiq keeps it.
        local extra = ',"error_class":"forkq.PoisonJob","error_message":'
          .. cjson.encode('killed its worker process ' .. count .. ' times'
                          .. (point and ' without its checkpoint moving' or ''))
        if decoded['failed_at'] == nil then
          extra = extra .. ',"failed_at":' .. ARGV[4]
        end
        local entry = string.gsub(job, '%s*}%s*$', '') .. extra .. '}'
        add_dead(entry, ARGV[4])
        if decoded['unique_for'] ~= nil or decoded['keep_result'] ~= nil or decoded['bid'] ~= nil then
          leavers[#leavers + 1] = entry
        end
        redis.call('DEL', key, key .. ':cursor')
        poisoned = poisoned + 1
      else
        suspected[#suspected + 1] = {suspects .. name, job}
        keep_listed(name)
      end
    elseif key and redis.call('EXISTS', key) == 1 then
      -- a suspect that was stopped, not crashed: next in line among the suspects again
      redis.call('RPUSH', suspects .. name, job)
      held = held + 1
      keep_listed(name)
    else
      redis.call('RPUSH', 'queue:' .. name, job)
      requeued = requeued + 1
      keep_listed(name)
    end
  end
end
-- new crash suspects join the far end of the line (a poison job that crashed again waits
-- behind the others), the oldest claim of this batch nearest the front
for i = #suspected, 1, -1 do
  redis.call('LPUSH', suspected[i][1], suspected[i][2])
end
local nsuspects = #suspected + held
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
-- the process is gone: off Sidekiq's process list now, not when its heartbeat expires
-- (a live process judged dead adds itself back at its next beat)
redis.call('SREM', 'processes', ARGV[1])
redis.call('UNLINK', ARGV[1], ARGV[1] .. ':work', ARGV[1] .. ':workers', 'forkq:alive:' .. ARGV[1])
return {requeued + nsuspects, poisoned, nsuspects, leavers}
