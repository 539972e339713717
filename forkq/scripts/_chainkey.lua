-- The list of a long chain's later steps (forkq:chain:FIRST_JID, chains.py) a member's
-- top-level forkq_chain refers to, or nil: a member an operator removes for good takes it
-- along, as nothing else would read it before its 210-day expiry. The text search first
-- ('q_chain"', not '"forkq_chain"': a plain find stops at each occurrence of the needle's
-- first character, and a payload is full of quotes: 0.2 against 0.45 us a member), then a decode only of members that name the field, to
-- tell a chain from an argument holding the word. Also whether it carries a chain at all.
local function chain_of(m)
  if not string.find(m, 'q_chain"', 1, true) then
    return false, nil
  end
  local ok, job = pcall(cjson.decode, m)
  if not ok or type(job) ~= 'table' or type(job['forkq_chain']) ~= 'table'
      or next(job['forkq_chain']) == nil then
    return false, nil
  end
  local key = job['forkq_chain']['key']
  if type(key) == 'string' and string.sub(key, 1, 12) == 'forkq:chain:' then
    return true, key
  end
  return true, nil
end
