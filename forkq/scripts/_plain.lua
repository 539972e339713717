-- Whether a member can need ending: a unique job's lock or a batch to count its failure in.
-- Kept for the caller when its text holds "unique_for", "bid" as a key, or a \u escape (a
-- key could be spelled with one); anything else, unparseable members included, has
-- nothing to end and can be removed here (Lua cannot name a lock: it is a SHA-256).
local function needs_ending(m)
  return string.find(m, 'unique_for', 1, true) or string.find(m, '"bid"', 1, true)
      or string.find(m, '\\u', 1, true)
end
