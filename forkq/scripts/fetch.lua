-- Claim up to ARGV[1] jobs for one process, and acknowledge finished ones, in one call.
-- A claimed job moves from its queue (or the process's landing list) into the process's
-- private in-flight hash within this script, so it never exists only in a client's memory.
--
-- KEYS[1]            the in-flight hash ("TOKEN\nQUEUE" -> PAYLOAD)
-- KEYS[2..]          nland landing lists, then the queue lists in the order to try
-- ARGV[1]            most jobs to claim (want)
-- ARGV[2]            nacks
-- ARGV[3]            1 if this call may be a resend of one that already ran (see below)
-- ARGV[4]            first token number (the caller advances it by ARGV[1] each call)
-- ARGV[5]            nafter: after-success actions to run with the acks (_after.lua)
-- ARGV[6..]          nacks fields to delete, then nafter (key, jid) pairs (a unique job's
--                    lock, or its batch), then the queue name of each KEYS[2..]
--
-- Reply: {{count from KEYS[2], ...}, jobs from the first key that gave any, jobs from the
-- next, ...}: one count per key tried, then each RPOP's own reply, as it came. The caller
-- numbers the jobs from ARGV[4] on. A resend that finds its first run's claims replies
-- {-1, field, queue, payload, ...}.
--
-- Each job's payload crosses into Lua (Redis converts RPOP's reply, and Lua hashes every
-- string it makes, byte by byte) and back out. The rest is kept cheap, in instructions
-- counted by callgrind (bench/redis_cost.py):
-- * the queue name rides in the field, not in the value, so a payload is stored as the
--   very string RPOP gave;
-- * RPOP's reply is returned as it is, not copied into a reply table;
-- * a token's digits are its tens, formatted once per ten tokens (the caller starts each
--   claim at a multiple of ten), then its last digit: a string.format for every field
--   cost about 8% of the claim;
-- * the field table is made big enough for ten jobs at once and filled by index, and
--   RPOP's reply is walked without ipairs.
-- Two ways to save Redis more would cost the client more than they save: sending the
-- tokens ready-made (each argument costs the client about 1,500 instructions to pack) and
-- sending the acks as an HDEL of their own (the client then reads a second reply).
local hash = KEYS[1]
local want = tonumber(ARGV[1])
local nacks = tonumber(ARGV[2])
local token = tonumber(ARGV[4])
local nafter = tonumber(ARGV[5])
local names = 5 + nacks + 2 * nafter
local DIGITS = {[0] = '0', '1', '2', '3', '4', '5', '6', '7', '8', '9'}
local function after_success(args, first, last)
--#include batch
--#include after
end

-- the acks of finished jobs, and the after-success actions of those that have any (a
-- unique job's lock released, a batch job's success counted): in the call that
-- acknowledges them, never in another
local function ack()
  if nacks > 0 then
    redis.call('HDEL', hash, unpack(ARGV, 6, 5 + nacks))
  end
  if nafter > 0 then
    after_success(ARGV, 6 + nacks, names)
  end
end

-- The same call sent again (under Sentinel the claim goes through redis-py, which retries
-- a command whose reply was lost, e.g. when Redis went down just after running it): the
-- first run's claims are under our tokens and nobody has them yet. Hand those over;
-- claiming afresh would overwrite them and lose them. The direct path never resends.
-- A first run that claimed anything claimed token ARGV[4] first.
if want > 0 and ARGV[3] == '1' then
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

local counts = {}
local out = {counts}
local fields = {nil, nil, nil, nil, nil, nil, nil, nil, nil, nil,
                nil, nil, nil, nil, nil, nil, nil, nil, nil, nil}
local n = 0
local tens
for i = 2, #KEYS do
  if n >= want then break end
  local got = redis.call('RPOP', KEYS[i], want - n)
  if got then
    local suffix = '\n' .. ARGV[names + i - 1]
    local c = #got
    for k = 1, c do
      local j = n + k - 1
      local t = token + j
      local d = t % 10
      if d == 0 or not tens then
        tens = t >= 10 and string.format('%d', (t - d) / 10) or ''
      end
      fields[2 * j + 1] = tens .. DIGITS[d] .. suffix
      fields[2 * j + 2] = got[k]
    end
    n = n + c
    counts[i - 1] = c
    out[#out + 1] = got
  else
    counts[i - 1] = 0
  end
end
if n > 0 then
  redis.call('HSET', hash, unpack(fields, 1, 2 * n))
end
-- after the claim: a hash that the acks emptied would be deleted, then made again
ack()
return out
