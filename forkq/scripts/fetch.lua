-- Claim up to ARGV[1] jobs for one process, and acknowledge finished ones, in one call.
-- A claimed job moves from its queue (or the process's landing list) into the process's
-- private in-flight hash within this script, so it never exists only in a client's memory.
--
-- KEYS[1]            the in-flight hash ("TOKEN\nQUEUE" -> PAYLOAD)
-- KEYS[2..]          nland landing lists, then the queue lists in the order to try
-- ARGV[1]            most jobs to claim
-- ARGV[2]            first token number (the caller advances it by ARGV[1] each call)
-- ARGV[3], ARGV[4]   nacks, nland
-- ARGV[5]            1 if this call may be a resend of one that already ran (see below)
-- ARGV[6..]          nacks fields to delete, then the queue name of each KEYS[2..]
--
-- Reply: {k, count from KEYS[2], ..., count from KEYS[k+1], payloads...}; the caller
-- numbers the payloads from ARGV[2] on. Token and queue name are not sent back for each
-- job: building and encoding them took a sixth of the script's time.
-- A resend that finds its first run's claims replies {-1, field, queue, payload, ...}.
--
-- Redis's Lua hashes every string it makes, whole: the queue name rides in the field, not
-- in the value, so a payload is stored as the very string RPOP gave (hashed once, not
-- twice), and each claim costs Redis about a sixth fewer instructions (callgrind).
local hash = KEYS[1]
local want = tonumber(ARGV[1])
local token = tonumber(ARGV[2])
local nacks = tonumber(ARGV[3])
local names = 5 + nacks

local function ack()
  if nacks > 0 then
    redis.call('HDEL', hash, unpack(ARGV, 6, 5 + nacks))
  end
end

-- The same call sent again (under Sentinel the claim goes through redis-py, which retries
-- a command whose reply was lost, e.g. when Redis went down just after running it): the
-- first run's claims are under our tokens and nobody has them yet. Hand those over;
-- claiming afresh would overwrite them and lose them. The direct path never resends.
-- A first run that claimed anything claimed token ARGV[2] first.
if want > 0 and ARGV[5] == '1' then
  for j = names + 1, #ARGV do
    if redis.call('HEXISTS', hash, string.format('%d\n%s', token, ARGV[j])) == 1 then
      local out = {-1}
      for t = token, token + want - 1 do
        -- a queue may be named twice (its landing list, then the queue): a token was used
        -- for one job, so the first field found is the only one
        for q = names + 1, #ARGV do
          local field = string.format('%d\n%s', t, ARGV[q])
          local v = redis.call('HGET', hash, field)
          if v then
            out[#out + 1] = field
            out[#out + 1] = ARGV[q]
            out[#out + 1] = v
            break
          end
        end
      end
      ack()
      return out
    end
  end
end

-- the reply is built as the jobs come: counts first, one slot per key tried
local out = {0}
local fields = {}
local n = 0
for i = 2, #KEYS do
  if n >= want then break end
  local got = redis.call('RPOP', KEYS[i], want - n)
  if got then
    local name = ARGV[names + i - 1]
    for _, job in ipairs(got) do
      fields[#fields + 1] = string.format('%d\n%s', token + n, name)
      fields[#fields + 1] = job
      n = n + 1
    end
    out[i] = #got
  else
    out[i] = 0
  end
end
out[1] = #out - 1
if n > 0 then
  redis.call('HSET', hash, unpack(fields))
  for i = 2, #fields, 2 do
    out[#out + 1] = fields[i]
  end
end
-- after the claim: a hash that the acks emptied would be deleted, then made again
ack()
return out
