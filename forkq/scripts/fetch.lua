-- Claim up to ARGV[1] jobs for one process, and acknowledge finished ones, in one call.
-- A claimed job moves from its queue (or the process's landing list) into the process's
-- private in-flight hash within this script, so it never exists only in a client's memory.
--
-- KEYS[1]            the in-flight hash (token -> "QUEUE\nPAYLOAD")
-- KEYS[2..]          nland landing lists, then the queue lists in the order to try
-- ARGV[1]            most jobs to claim
-- ARGV[2]            first token number (the caller advances it by ARGV[1] each call)
-- ARGV[3], ARGV[4]   nacks, nland
-- ARGV[5]            1 if this call may be a resend of one that already ran (see below)
-- ARGV[6..]          nacks tokens to delete, then the queue name of each KEYS[2..]
--
-- Reply: {k, count from KEYS[2], ..., count from KEYS[k+1], payloads...}; the caller
-- numbers the payloads from ARGV[2] on. Token and queue name are not sent back for each
-- job: building and encoding them took a sixth of the script's time.
-- A resend that finds its first run's claims replies {-1, token, queue, payload, ...}.
local hash = KEYS[1]
local want = tonumber(ARGV[1])
local token = tonumber(ARGV[2])
local nacks = tonumber(ARGV[3])
local nland = tonumber(ARGV[4])
if nacks > 0 then
  redis.call('HDEL', hash, unpack(ARGV, 6, 5 + nacks))
end
local names = 5 + nacks
-- The same call sent again (under Sentinel the claim goes through redis-py, which retries
-- a command whose reply was lost, e.g. when Redis went down just after running it): the
-- first run's claims are under our tokens and nobody has them yet. Hand those over;
-- claiming afresh would overwrite them and lose them. The direct path never resends.
if want > 0 and ARGV[5] == '1' and redis.call('HEXISTS', hash, tostring(token)) == 1 then
  local out = {-1}
  for t = token, token + want - 1 do
    local v = redis.call('HGET', hash, tostring(t))
    if v then
      local cut = string.find(v, "\n", 1, true)
      out[#out + 1] = tostring(t)
      out[#out + 1] = string.sub(v, 1, cut - 1)
      out[#out + 1] = string.sub(v, cut + 1)
    end
  end
  return out
end
local counts, jobs, fields = {}, {}, {}
local n = 0
for i = 2, #KEYS do
  if n >= want then break end
  local got = redis.call('RPOP', KEYS[i], want - n)
  if got then
    local name = ARGV[names + i - 1] .. "\n"
    for _, job in ipairs(got) do
      fields[#fields + 1] = string.format('%d', token + n)  -- tostring goes through %.14g: slower
      fields[#fields + 1] = name .. job
      jobs[#jobs + 1] = job
      n = n + 1
    end
    counts[#counts + 1] = #got
  else
    counts[#counts + 1] = 0
  end
end
if n > 0 then
  redis.call('HSET', hash, unpack(fields))
end
local out = {#counts}
for _, c in ipairs(counts) do out[#out + 1] = c end
for _, job in ipairs(jobs) do out[#out + 1] = job end
return out
