-- Claim ONE suspect (a job that was in flight in a process that crashed) into a process's
-- in-flight hash, to run alone there, and acknowledge what that process finished since its
-- last call. The caller has every processor idle, so after the acks the hash should be
-- empty: whatever is still in it is held by no thread of the process, and goes back before
-- the claim (a suspect's crash would otherwise count against it too).
--
-- KEYS[1]   the in-flight hash ("TOKEN\nQUEUE" -> PAYLOAD)
-- KEYS[2..] the suspects lists of the process's queues, in the order to try them (plain
--           payloads; RPOP takes the next)
-- ARGV[1]   the token number for the claim
-- ARGV[2]   nacks, ARGV[3] ncleared, ARGV[4] crash-count key prefix, ARGV[5] suspects-list
--           key prefix
-- ARGV[6..] nacks fields to delete, then ncleared crash ids (crash_id) of suspects that
--           ran to their end (their crash counts are deleted), then the queue name of each
--           of KEYS[2..]
-- Returns {returned} when there is no suspect, else {returned, field, queue, payload};
-- returned counts the leftovers put back.
--#include entry
local hash = KEYS[1]
local token = ARGV[1]
local nacks = tonumber(ARGV[2])
local ncleared = tonumber(ARGV[3])
local prefix, suspects = ARGV[4], ARGV[5]
local names = 6 + nacks + ncleared  -- ARGV index of the queue name of KEYS[2]
if nacks > 0 then
  redis.call('HDEL', hash, unpack(ARGV, 6, 5 + nacks))
end
for i = 6 + nacks, 5 + nacks + ncleared do
  redis.call('DEL', prefix .. ARGV[i])
end

local flat = redis.call('HGETALL', hash)
-- The same call sent again after a lost reply: the first run's claim is under our token
-- and no thread has it yet. Hand it over; claiming afresh would leave it stranded.
for i = 1, #flat, 2 do
  if claimed(flat[i]) == tonumber(token) then
    local name, job = entry(flat[i], flat[i + 1])
    if name then
      return {0, flat[i], name, job}
    end
  end
end

local returned, malformed = 0, 0
if #flat > 0 then
  local items = {}
  for i = 1, #flat, 2 do
    items[#items + 1] = {claimed(flat[i]), flat[i], flat[i + 1]}
  end
  table.sort(items, function(a, b) return a[1] > b[1] end)
  for _, item in ipairs(items) do
    local name, job = entry(item[2], item[3])
    if not name then
      malformed = malformed + 1
      malformed_to_dead(item[3], 'in-flight entry of unknown form (field ' .. item[2] .. ')', malformed)
    else
      local id = crash_id(job)
      if id and redis.call('EXISTS', prefix .. id) == 1 then
        redis.call('RPUSH', suspects .. name, job)
      else
        redis.call('RPUSH', 'queue:' .. name, job)
      end
      keep_listed(name)
      returned = returned + 1
    end
  end
  redis.call('DEL', hash)
end

-- Any entry is claimed as it is, as fetch claims from a queue: one that is no job (garbage
-- a client wrote there) goes to dead from the processor, with the parse error as reason.
for i = 2, #KEYS do
  local job = redis.call('RPOP', KEYS[i])
  if job then
    local name = ARGV[names + i - 2]
    local field = token .. "\n" .. name
    redis.call('HSET', hash, field, job)
    return {returned, field, name, job}
  end
end
return {returned}
