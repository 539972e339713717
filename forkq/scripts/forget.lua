-- Remove entries an operator deletes (forkq dead/queues, forkq.api, the dashboard), and
-- end each one this call removed as a job leaving for good ends: release its unique lock,
-- while it still holds the jid, and count it as failed in its batch, so that the batch's
-- `complete` can fire (its success never will). Only for an entry this call took out: one
-- another process moved meanwhile (the scheduler, a worker's claim) is still a pending job.
-- KEYS[1] the sorted set or the queue list
-- ARGV[1] 'zset', 'list' or 'near', ARGV[2] the failure a batch records (JSON), for 'near'
-- the arguments below, then (member, lock key or '', jid, batch key or '') quadruplets
-- A removed entry's jid also names an iterable job's checkpoint (forkq:iter:JID), which
-- goes with it, in one DEL a call (a key that does not exist costs a lookup), as does
-- the list of later steps of a long chain the entry refers to (_chainkey.lua).
-- Returns how many entries were removed.
-- Each batch is checked once, after all its entries: a clear's page of 1,000 entries of
-- one batch checked it 1,000 times (about half the call's time).
--
-- 'list' removes each entry with LREM 1, which walks the list from its head to it: fine
-- for one, quadratic for many on a long queue (a thousand walks of a million entries).
-- 'near' (api.Queue) is given the index each entry was read at, and looks for it there,
-- then, if pushes or removals moved it, around there (up to ARGV[4] entries read per
-- call); what it finds it overwrites with the tombstone ARGV[3] (LSET seeks by node,
-- from the nearer end on Redis 7), and one LREM from the nearer end, which stops at the
-- last tombstone, removes them all: one walk into the list a call, not one per entry. A
-- tombstone never outlives the call, so no worker can pop one.
-- ARGV[5] how many entries, ARGV[6..] their indices, lowest first, then the quadruplets
-- in the same order.
--#include batch
--#include unlock
--#include chainkey
local kind = ARGV[1]
local first = kind == 'near' and 6 + tonumber(ARGV[5]) or 3

local RUN_GAP = 64  -- entries read closer than this are read again in one LRANGE
-- ... unless the entries between are likely to hold more bytes than this: each row an
-- LRANGE returns is copied into Lua, which costs far more than LRANGE's seek to a node
local RUN_BYTES = 65536
local BEHIND, AHEAD = 100, 2000  -- the first search around entries not where they were
-- bytes the searches of one call read at most, besides ARGV[4]'s entries (cancel.py's
-- SCAN_BYTES): 20,000 entries of 20 KB took 4 s of Redis to look for one a worker took
local SEARCH_BYTES = 8388608

local function near_remove()
  local key, tomb, budget = KEYS[1], ARGV[3], tonumber(ARGV[4])
  local bytes = SEARCH_BYTES
  local len = redis.call('LLEN', key)
  local gone, found, low, high = {}, 0, len, -1
  local shift = 0  -- how far the last entry found had moved: the next likely moved as far
  local function expected(q)
    return tonumber(ARGV[6 + (q - first) / 4])
  end
  -- the entries of quadruplets qs found among rows read from index `at`, each looked for
  -- near where it was read plus `guess` (the move assumed), or with `exact` only there;
  -- returns the others. Of equal entries (one job pushed twice) the nearest is taken: the
  -- first one met was often the other copy, which left the one kept ahead of jobs it had
  -- been queued behind.
  local function match(rows, at, qs, guess, exact)
    local wanted, members = {}, {}
    for _, q in ipairs(qs) do
      local same = wanted[ARGV[q]]
      if same then
        same[#same + 1] = q
      else
        wanted[ARGV[q]] = {q}
        members[#members + 1] = ARGV[q]
      end
    end
    local at_rows = {}
    for j = 1, #rows do
      if wanted[rows[j]] then
        local where = at_rows[rows[j]]
        if where then
          where[#where + 1] = at + j - 1
        else
          at_rows[rows[j]] = {at + j - 1}
        end
      end
    end
    local left = {}
    for _, m in ipairs(members) do
      local where = at_rows[m] or {}
      for _, q in ipairs(wanted[m]) do
        local near, best = 1, math.abs((where[1] or 0) - expected(q) - guess)
        for k = 2, #where do
          local d = math.abs(where[k] - expected(q) - guess)
          if d <= best then  -- a tie: the later one (pushes move entries on, not back)
            near, best = k, d
          end
        end
        if #where == 0 or exact and best > 0 then
          left[#left + 1] = q
        else
          local index = table.remove(where, near)
          -- negative past the middle: a Redis before 7 seeks a positive index from the head
          redis.call('LSET', key, index < len / 2 and index or index - len, tomb)
          gone[q] = true
          found = found + 1
          low = math.min(low, index)
          high = math.max(high, index)
          shift = index - expected(q)
        end
      end
    end
    return left
  end
  -- look for the entries of `left` from BEHIND before lo on, reading more each time
  -- (a read is sized by the bytes left and the size of the entries read so far, at first
  -- of one sought: it cannot know an entry's size before it reads it)
  local function search(left, lo, hi, guess)
    -- (`to` below 0 would be counted from the right end by LRANGE)
    local from, to = math.max(lo - BEHIND, 0), math.max(hi + AHEAD, 0)
    local seen, size = 0, #ARGV[left[1] or first] + 1
    while #left > 0 and budget > 0 and bytes > 0 and from < len do
      to = math.min(to, from + budget - 1, from + math.floor(bytes / size))
      local rows = redis.call('LRANGE', key, from, to)
      budget = budget - #rows
      for j = 1, #rows do
        bytes = bytes - #rows[j] - 1
      end
      seen = seen + #rows
      size = math.max(1, math.floor((SEARCH_BYTES - bytes) / math.max(seen, 1)))
      left = match(rows, from, left, guess)
      from, to = to + 1, to + 2 * (to - from + 1)
    end
    return left
  end
  local q = first
  while q < #ARGV do
    local run = {q}
    while q + 4 < #ARGV and expected(q + 4) - expected(q) < RUN_GAP
        and (expected(q + 4) - expected(q)) * #ARGV[q + 4] < RUN_BYTES do
      q = q + 4
      run[#run + 1] = q
    end
    q = q + 4
    local lo = math.max(expected(run[1]) + shift, 0)
    local hi = expected(run[#run]) + shift
    -- (hi below 0 would be counted from the right end by LRANGE)
    local left = hi < lo and run or match(redis.call('LRANGE', key, lo, hi), lo, run, shift, true)
    -- moved: a push moves an entry one from the head, a removal nearer the head one back.
    -- Around where the last one found had moved to, then around where these were read:
    -- entries read later than it (apply gathers pages over half a second) moved less.
    local guess = shift
    left = search(left, lo, hi, guess)
    local read_lo = math.max(expected(run[1]), 0)
    if #left > 0 and read_lo ~= lo then
      left = search(left, read_lo, expected(run[#run]), 0)
    end
  end
  if found > 0 then
    redis.call('LREM', key, high + 1 <= len - low and found or -found, tomb)
  end
  return gone
end

local gone = kind == 'near' and near_remove() or nil
local removed = 0
local failed, order = {}, {}
local points = {}  -- the checkpoints of removed entries
for i = first, #ARGV, 4 do
  local n
  if kind == 'zset' then
    n = redis.call('ZREM', KEYS[1], ARGV[i])
  elseif kind == 'list' then
    n = redis.call('LREM', KEYS[1], 1, ARGV[i])
  else
    n = gone[i] and 1 or 0
  end
  if n > 0 then
    removed = removed + n
    if ARGV[i + 2] ~= '' then
      points[#points + 1] = 'forkq:iter:' .. ARGV[i + 2]
    end
    local _, list = chain_of(ARGV[i])
    points[#points + 1] = list
    if ARGV[i + 1] ~= '' then
      unlock(ARGV, i + 1, i + 2)
    end
    local b = ARGV[i + 3]
    if b ~= '' and batch_note_failure(b, ARGV[i + 2], ARGV[2]) and not failed[b] then
      failed[b] = true
      order[#order + 1] = b
    end
  end
end
for _, b in ipairs(order) do
  batch_failed(b)
end
for i = 1, #points, 500 do
  redis.call('DEL', unpack(points, i, math.min(i + 499, #points)))
end
return removed
