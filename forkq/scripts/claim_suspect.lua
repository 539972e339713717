-- Claim ONE suspect (a job that was in flight in a process that crashed) into a process's
-- in-flight hash, to run alone there, and acknowledge what that process finished since its
-- last call. The caller has every processor idle, so after the acks the hash should be
-- empty: whatever is still in it is held by no thread of the process, and goes back before
-- the claim (a suspect's crash would otherwise count against it too).
--
-- KEYS[1]   the in-flight hash ("TOKEN\nQUEUE" -> PAYLOAD)
-- KEYS[2]   the suspects list ("QUEUE\nPAYLOAD" entries; RPOP takes the next)
-- ARGV[1]   the token number for the claim
-- ARGV[2]   nacks, ARGV[3] ncleared, ARGV[4] crash-count key prefix
-- ARGV[5..] nacks fields to delete, then ncleared jids of suspects that ran to their end
--           (their crash counts are deleted)
-- Returns {returned} when there is no suspect, else {returned, field, queue, payload};
-- returned counts the leftovers put back.
--#include entry
local hash, suspects = KEYS[1], KEYS[2]
local token = ARGV[1]
local nacks = tonumber(ARGV[2])
local ncleared = tonumber(ARGV[3])
local prefix = ARGV[4]
if nacks > 0 then
  redis.call('HDEL', hash, unpack(ARGV, 5, 4 + nacks))
end
for i = 5 + nacks, 4 + nacks + ncleared do
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
      local ok, decoded = pcall(cjson.decode, job)
      if ok and type(decoded) == 'table' and type(decoded['jid']) == 'string'
          and redis.call('EXISTS', prefix .. decoded['jid']) == 1 then
        redis.call('RPUSH', suspects, name .. "\n" .. job)
      else
        redis.call('RPUSH', 'queue:' .. name, job)
      end
      returned = returned + 1
    end
  end
  redis.call('DEL', hash)
end

-- An entry that is not "QUEUE\nPAYLOAD" was not written by forkq: it cannot be run or
-- put back anywhere, so it goes to dead, and the next one is taken. Left in place it
-- would fail every claim and wedge the worker.
local v = redis.call('RPOP', suspects)
while v and not string.find(v, "\n", 1, true) do
  malformed = malformed + 1
  malformed_to_dead(v, 'forkq:suspects entry is not QUEUE<newline>PAYLOAD', malformed)
  v = redis.call('RPOP', suspects)
end
if not v then
  return {returned}
end
local name, job = entry(token, v)  -- a bare token number: v is "QUEUE\nPAYLOAD"
local field = token .. "\n" .. name
redis.call('HSET', hash, field, job)
return {returned, field, name, job}
