-- Whether a member can need ending: a unique job's lock or a batch to count its failure in.
-- Kept for the caller when its text holds "unique_for", "bid" as a key, or a \u escape (a
-- key could be spelled with one); anything else, unparseable members included, has
-- nothing to end and can be removed here (Lua cannot name a lock: it is a SHA-256).
local function needs_ending(m)
  return string.find(m, 'unique_for', 1, true) or string.find(m, '"bid"', 1, true)
      or string.find(m, '\\u', 1, true)
end

-- Which of `members` may be an iterable job with a checkpoint (forkq:iter:JID), to be kept
-- for the caller too, which has forget.lua delete the checkpoint with the entry: a set of
-- their indices. One MGET per 500 members. The jid is read off the text, with or without
-- spaces around its colon, when the text has one "jid" key; the args come before the
-- job's own jid (as forkq and Sidekiq write a payload) and may hold dicts with a "jid" of
-- their own (a chain's later steps do too), so a text with more than one, or with an
-- escape in it, is decoded for its own: the first found hid the job's, left for its TTL,
-- and looking up every one cost a page of jobs listing 200 jids each 1 s of Redis. Inside
-- a string a "jid" has its quotes escaped, so it is not met.
local function own_jid(m)
  local jid, from = nil, 1
  while true do
    local _, b = string.find(m, '"jid"', from, true)
    if not b then
      break
    end
    local q = b + 2  -- ':"', as compact JSON has it, is not worth a pattern's time
    if string.sub(m, b + 1, q) ~= ':"' then
      _, q = string.find(m, '^%s*:%s*"', b + 1)
    end
    local e = q and string.find(m, '"', q + 1, true)
    if e then
      if jid then
        jid = nil
        break
      end
      jid = string.sub(m, q + 1, e - 1)
      from = e + 1
    else
      from = b + 1
    end
  end
  if jid and not string.find(jid, '\\', 1, true) then
    return jid
  end
  if from == 1 then
    return nil  -- no "jid" at all
  end
  local ok, decoded = pcall(cjson.decode, m)
  if ok and type(decoded) == 'table' and type(decoded['jid']) == 'string' then
    return decoded['jid']
  end
  return nil
end

local function checkpointed(members)
  local names, at, out = {}, {}, {}
  for i, m in ipairs(members) do
    local jid = own_jid(m)
    if jid then
      names[#names + 1] = 'forkq:iter:' .. jid
      at[#names] = i
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
