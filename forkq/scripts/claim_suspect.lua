-- Claim ONE suspect (a job that was in flight in a process that crashed) into a process's
-- in-flight hash, to run alone there, and acknowledge what that process finished since its
-- last call. The caller has every processor idle, so after the acks the hash should be
-- empty: whatever is still in it is held by no thread of the process, and goes back before
-- the claim (a suspect's crash would otherwise count against it too).
--
-- KEYS[1]   the in-flight hash (token -> "QUEUE\nPAYLOAD")
-- KEYS[2]   the suspects list ("QUEUE\nPAYLOAD" entries; RPOP takes the next)
-- ARGV[1]   the token for the claim
-- ARGV[2]   nacks, ARGV[3] ncleared, ARGV[4] crash-count key prefix
-- ARGV[5..] nacks tokens to delete, then ncleared jids of suspects that ran to their end
--           (their crash counts are deleted)
-- Returns {returned} when there is no suspect, else {returned, token, queue, payload};
-- returned counts the leftovers put back.
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

local function split(v)
  local cut = string.find(v, "\n", 1, true)
  return string.sub(v, 1, cut - 1), string.sub(v, cut + 1)
end

-- The same call sent again after a lost reply: the first run's claim is under our token
-- and no thread has it yet. Hand it over; claiming afresh would leave it stranded.
local again = redis.call('HGET', hash, token)
if again then
  local name, job = split(again)
  return {0, token, name, job}
end

local returned = 0
local flat = redis.call('HGETALL', hash)
if #flat > 0 then
  local items = {}
  for i = 1, #flat, 2 do
    items[#items + 1] = {tonumber(flat[i]) or 0, flat[i + 1]}
  end
  table.sort(items, function(a, b) return a[1] > b[1] end)
  for _, item in ipairs(items) do
    local v = item[2]
    local name, job = split(v)
    local ok, decoded = pcall(cjson.decode, job)
    if ok and type(decoded) == 'table' and type(decoded['jid']) == 'string'
        and redis.call('EXISTS', prefix .. decoded['jid']) == 1 then
      redis.call('RPUSH', suspects, v)
    else
      redis.call('RPUSH', 'queue:' .. name, job)
    end
    returned = returned + 1
  end
  redis.call('DEL', hash)
end

-- An entry that is not "QUEUE\nPAYLOAD" was not written by forkq: it cannot be run or
-- put back anywhere, so it goes to dead with the reason (its bytes kept), and the next one
-- is taken. Left in place it would fail every claim and wedge the worker.
local v = redis.call('RPOP', suspects)
while v and not string.find(v, "\n", 1, true) do
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  redis.call('ZADD', 'dead', now, cjson.encode({
    ['class'] = 'forkq.MalformedJob', args = {}, jid = string.format('%012x%012x', t[1], t[2]),
    queue = '', retry = false, error_class = 'forkq.MalformedPayload',
    error_message = 'forkq:suspects entry is not QUEUE<newline>PAYLOAD', failed_at = now,
    forkq_original = v}))
  v = redis.call('RPOP', suspects)
end
if not v then
  return {returned}
end
redis.call('HSET', hash, token, v)
local name, job = split(v)
return {returned, token, name, job}
