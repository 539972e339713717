-- Whether a member can need ending: a unique job's lock or a batch to count its failure in.
-- Kept for the caller when its text holds "unique_for", "bid" as a key, or a \u escape (a
-- key could be spelled with one); anything else, unparseable members included, has
-- nothing to end and can be removed here (Lua cannot name a lock: it is a SHA-256).
local function needs_ending(m)
  return string.find(m, 'unique_for', 1, true) or string.find(m, '"bid"', 1, true)
      or string.find(m, '\\u', 1, true)
end

-- Which of `members` may be an iterable job with a checkpoint (forkq:iter:JID), to be kept
-- for the caller too, which parses the jid and has forget.lua delete the checkpoint with
-- the entry: a set of their indices. The jid is read off the text, no decoding here: each
-- "jid" key's string value, with or without spaces around its colon. Every one is looked
-- up, not the first: the args come before the job's own jid (as forkq and Sidekiq write a
-- payload), and a dict among them with a "jid" of a job without a checkpoint hid the
-- job's. A "jid" in the args of a job with one costs only a parse; inside a string its
-- quotes are escaped, so it is not met. One MGET per 500 names.
local function checkpointed(members)
  local names, at, out = {}, {}, {}
  for i, m in ipairs(members) do
    local from = 1
    while true do
      local _, b = string.find(m, '"jid"', from, true)
      if not b then
        break
      end
      local _, q = string.find(m, '^%s*:%s*"', b + 1)
      local e = q and string.find(m, '"', q + 1, true)
      if e then
        names[#names + 1] = 'forkq:iter:' .. string.sub(m, q + 1, e - 1)
        at[#names] = i
        from = e + 1
      else
        from = b + 1
      end
    end
  end
  for s = 1, #names, 500 do
    local got = redis.call('MGET', unpack(names, s, math.min(s + 499, #names)))
    for k = 1, #got do
      if got[k] then
        out[at[s + k - 1]] = true
      end
    end
  end
  return out
end
