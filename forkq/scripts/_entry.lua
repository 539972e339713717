-- An in-flight entry's queue and payload. forkq writes "TOKEN\nQUEUE" -> PAYLOAD; earlier
-- versions wrote "TOKEN" -> "QUEUE\nPAYLOAD", which a process of such a version may still
-- hold when a newer one puts its jobs back. (nil, nil) for an entry in neither form.
local function entry(field, v)
  local cut = string.find(field, "\n", 1, true)
  if cut then
    return string.sub(field, cut + 1), v
  end
  cut = string.find(v, "\n", 1, true)
  if cut then
    return string.sub(v, 1, cut - 1), string.sub(v, cut + 1)
  end
  return nil, nil
end

-- What a job's crash count (forkq:crashes:ID) is kept under, and the decoded job: its jid,
-- or, for a job pushed without a string jid (forkq runs it all the same), "sha1:" and the
-- SHA1 of its payload, which is the same bytes each time it is put back (fetch.crash_id
-- names it the same way). Without one, such a job that killed its process went back onto
-- its queue uncounted, every time, and crashed the fleet forever. nil for a payload that
-- is no JSON: it is never run, so it cannot have crashed anything.
local function crash_id(job)
  local ok, decoded = pcall(cjson.decode, job)
  if not ok or type(decoded) ~= 'table' then
    return nil, nil
  end
  if type(decoded['jid']) == 'string' then
    return decoded['jid'], decoded
  end
  return 'sha1:' .. redis.sha1hex(job), decoded
end

-- the claim order of an entry: its token number
local function claimed(field)
  return tonumber(string.match(field, "^%d+")) or 0
end

-- A member for the dead set, trimmed afterwards with the calls Sidekiq makes on every
-- insert (keys.DEAD_TIMEOUT_S and keys.DEAD_MAX_JOBS; a test holds these numbers to them):
-- rank -10000 leaves 9,999 entries, as Sidekiq's DeadSet#kill does.
local function add_dead(member, now)
  redis.call('ZADD', 'dead', now, member)
  redis.call('ZREMRANGEBYSCORE', 'dead', '-inf', tonumber(now) - 15552000)
  redis.call('ZREMRANGEBYRANK', 'dead', 0, -10000)
end

-- What forkq cannot run or put back anywhere goes to dead with the reason, its bytes kept:
-- left in place it would fail every later call. `n` tells apart those sent in one call.
-- Its queue is one nobody serves, so Sidekiq's "Retry" (which refuses an empty queue and
-- drops the entry) parks it there instead of losing it; "args" is spliced in as text
-- because cjson writes an empty table as {}, which Sidekiq refuses as well.
local function malformed_to_dead(original, reason, n)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local rest = cjson.encode({
    ['class'] = 'forkq.MalformedJob', jid = string.format('%012x%06x%06x', t[1], t[2], n),
    queue = 'forkq-malformed', retry = false, error_class = 'forkq.MalformedPayload',
    error_message = reason, failed_at = now, forkq_original = original})
  add_dead('{"args":[],' .. string.sub(rest, 2), now)
end

-- Keep queue `name` in the `queues` set when a job goes back onto it (or its suspects list).
-- Sidekiq's Clear (Sidekiq::Queue#clear) deletes a queue and takes it out of the set while
-- forkq still holds that queue's jobs in flight; a job put back then on a queue missing from
-- the set waits unseen by Sidekiq's Web UI and Stats and by `forkq queues` and `forkq stats`.
-- Once per name and call.
local listed = {}
local function keep_listed(name)
  if not listed[name] then
    listed[name] = true
    redis.call('SADD', 'queues', name)
  end
end
