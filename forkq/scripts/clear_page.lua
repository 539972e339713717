-- One step of emptying a sorted set (api.SortedSet.clear): look at its lowest-ranked
-- entries, remove here those that cannot hold a unique lock, belong to a batch nor have an
-- iterable job's checkpoint (a long chain's list of later steps goes with them: _chainkey),
-- and return the others, which the caller ends with forget.lua
-- (see _plain.lua for which).
-- Removed and read in one call: an entry added meanwhile is either looked at here or left
-- for the next step, never dropped unseen.
-- KEYS[1] the set, ARGV[1] how many entries to look at
-- Returns {entries looked at, entries removed, then the members left to end}
--#include plain
--#include chainkey
local members = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
local plain, others = {}, {1, 1}
local points = checkpointed(members)
for i, m in ipairs(members) do
  if points[i] or needs_ending(m) then
    others[#others + 1] = m
  else
    plain[#plain + 1] = m
  end
end
local lists = {}
for _, m in ipairs(plain) do
  local _, list = chain_of(m)
  lists[#lists + 1] = list
end
for i = 1, #lists, 500 do
  redis.call('DEL', unpack(lists, i, math.min(i + 499, #lists)))
end
local removed = 0
for i = 1, #plain, 500 do
  removed = removed + redis.call('ZREM', KEYS[1], unpack(plain, i, math.min(i + 499, #plain)))
end
others[1] = #members
others[2] = removed
return others
