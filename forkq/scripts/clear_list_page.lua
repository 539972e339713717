-- One step of emptying a queue (api.Queue.clear): take its next-to-run entries with the
-- RPOP workers use, drop those with nothing to end (_plain.lua: no unique lock, no batch,
-- no iterable job's checkpoint), and put the others back
-- where they were, at the right end in their order, returning them for the caller to end
-- with forget.lua's 'window' (their lock keys are SHA-256s Lua cannot make). Between the
-- two calls they are in the queue as before: a client that dies there leaves jobs a worker
-- runs, never ones removed unended, and a worker that takes one meanwhile ends it itself
-- (forget.lua finds it gone and ends nothing). Producers push at the other end.
-- KEYS[1] the queue, ARGV[1] how many entries to take
-- Returns {entries taken, entries dropped, the queue's length after, how many of those
-- dropped carried the rest of a chain (a non-empty forkq_chain: its later steps will not
-- run, which the operator is told; a long chain's list of them goes, _chainkey.lua), then
-- the entries put back, leftmost first: the last of them is at index length - 1}
--
-- Fewer are taken once they hold MAX_BYTES (at least one): every entry is copied into Lua,
-- and the kept ones back and to the client, so 1,000 jobs of 100 KB held Redis 0.3-0.8 s
-- a call. The pops are sized by the entries' size so far, from a first small one.
--#include plain
--#include chainkey
local MAX_BYTES = 8388608
local want = tonumber(ARGV[1])
local taken, bytes, n = {}, 0, 16
while #taken < want and bytes < MAX_BYTES do
  local got = redis.call('RPOP', KEYS[1], math.min(n, want - #taken))
  if not got then
    break
  end
  for i = 1, #got do
    taken[#taken + 1] = got[i]
    bytes = bytes + #got[i]
  end
  n = math.max(1, math.floor((MAX_BYTES - bytes) / math.max(1, bytes / #taken)))
end
if #taken == 0 then
  return {0, 0, 0, 0}
end
-- RPOP gives the rightmost first: walked backwards, RPUSH puts them back in place
local out = {#taken, 0, 0, 0}
local points = checkpointed(taken)
local chained, lists = 0, {}
for i = #taken, 1, -1 do
  if points[i] or needs_ending(taken[i]) then
    out[#out + 1] = taken[i]
  else
    local carries, list = chain_of(taken[i])
    if carries then
      chained = chained + 1
      lists[#lists + 1] = list
    end
  end
end
for i = 1, #lists, 500 do
  redis.call('DEL', unpack(lists, i, math.min(i + 499, #lists)))
end
local len = redis.call('LLEN', KEYS[1])
for i = 5, #out, 500 do
  len = redis.call('RPUSH', KEYS[1], unpack(out, i, math.min(i + 499, #out)))
end
out[2] = #taken - (#out - 4)
out[3] = len
out[4] = chained
return out
