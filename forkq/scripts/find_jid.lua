-- Find a job by its jid without sending the structure to the client (cancel.locate).
-- KEYS[1] a queue or suspects list ('list'), the schedule, retry or dead set ('zset'), or
-- up to two running-jobs / in-flight hashes ('work': IDENTITY:work and IDENTITY:workers;
-- 'inflight': forkq:inflight:IDENTITY)
-- ARGV[1] 'list', 'zset', 'work' or 'inflight', ARGV[2] the jid, then for 'list' and
-- 'zset' ARGV[3] the index to start at (a list's from the left, the newest end; a sorted
-- set's rank from the highest score), ARGV[4] how many entries to look at and ARGV[5] how
-- many bytes of them (a slice of 500 entries at a time).
-- Candidates are picked by a plain substring match of the jid, then decoded: a jid that
-- only appears in an argument, or a payload written with spaces after its colons (another
-- client), is told apart by the decoded "jid" alone.
-- Returns for 'list' {found index or -1, next start, length, raw or nil}: the client loops
-- while next start < length. Scanning from the left, a job that stays on the list is never
-- skipped by pushes (LPUSH moves it away from the scanned part) or pops (at the right end).
-- For 'zset' the same, with the match's score after it. From the highest score: entries
-- leave these sets at the low end (due, or trimmed), which moves no rank counted from the
-- top, and one added above the scan makes it see an entry twice, never skip one.
-- For the hashes {field, value} of the first match, or {}.
local jid = ARGV[2]

local function is_job(text)
  if not string.find(text, jid, 1, true) then
    return false
  end
  local ok, job = pcall(cjson.decode, text)
  return ok and type(job) == 'table' and job['jid'] == jid
end

if ARGV[1] == 'list' then
  -- at most ARGV[4] entries, and past ARGV[5] bytes no further slice: a queue of large
  -- payloads must not be copied into this script by the gigabyte, nor hold Redis long
  local start = tonumber(ARGV[3])
  local count = tonumber(ARGV[4])
  local budget = tonumber(ARGV[5])
  local len = redis.call('LLEN', KEYS[1])
  local at, bytes = start, 0
  while at < start + count and at < len and bytes < budget do
    local items = redis.call('LRANGE', KEYS[1], at, math.min(at + 499, start + count - 1))
    for i, raw in ipairs(items) do
      if is_job(raw) then
        return {at + i - 1, at + #items, len, raw}
      end
      bytes = bytes + #raw
    end
    if #items == 0 then
      break
    end
    at = at + #items
  end
  return {-1, at, len}
end

if ARGV[1] == 'zset' then
  local start = tonumber(ARGV[3])
  local count = tonumber(ARGV[4])
  local budget = tonumber(ARGV[5])
  local card = redis.call('ZCARD', KEYS[1])
  local at, bytes = start, 0
  while at < start + count and at < card and bytes < budget do
    local items = redis.call('ZREVRANGE', KEYS[1], at, math.min(at + 499, start + count - 1), 'WITHSCORES')
    local n = #items / 2
    for i = 1, n do
      local raw = items[2 * i - 1]
      if is_job(raw) then
        return {at + i - 1, at + n, card, raw, items[2 * i]}
      end
      bytes = bytes + #raw
    end
    if n == 0 then
      break
    end
    at = at + n
  end
  return {-1, at, card}
end

for _, key in ipairs(KEYS) do
  if redis.call('TYPE', key)['ok'] == 'hash' then
    local flat = redis.call('HGETALL', key)
    for i = 1, #flat, 2 do
      local value = flat[i + 1]
      if string.find(value, jid, 1, true) then
        local text = value
        if ARGV[1] == 'inflight' then
          -- "QUEUE\nPAYLOAD"
          local nl = string.find(value, '\n', 1, true)
          text = nl and string.sub(value, nl + 1) or value
        else
          -- {"queue": ..., "payload": "<the job's JSON as a string>" or the job itself, ...}
          local ok, entry = pcall(cjson.decode, value)
          text = ''
          if ok and type(entry) == 'table' then
            local p = entry['payload']
            if type(p) == 'string' then
              text = p
            elseif type(p) == 'table' then
              text = p['jid'] == jid and jid or ''
              if text ~= '' then
                return {flat[i], value}
              end
            end
          end
        end
        if is_job(text) then
          return {flat[i], value}
        end
      end
    end
  end
end
return {}
