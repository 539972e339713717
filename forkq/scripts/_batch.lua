-- Batches (forkq/batch.py): a job's end counted in its batch, and the batch's callbacks
-- pushed, each once, when its condition first holds. A batch B is three keys:
--   B           hash: description, created_at, total (jobs pushed into it), sealed ('1'
--               once no job can join), the callbacks (on_success / on_complete: payload
--               text, and *_queue), success_at / complete_at once fired, abandoned
--   B:jids      set of its jobs that have not succeeded (yet)
--   B:failed    hash jid -> JSON of the last failure of each of those that failed
-- A success removes its jid from B:jids: a job that runs again (its process was killed
-- before its ack) finds it gone and counts once, and a payload naming a batch it was never
-- pushed into, or one whose keys expired, changes nothing. B:failed holds only jids of
-- B:jids, so the batch is complete when the two are the same size.
--#include batchttl

-- Refreshed as jobs end, at most once a day per batch: `probe` is the key just written,
-- which has no TTL if this write made it (-1).
local function batch_refresh(b, probe)
  if redis.call('TTL', probe) < BATCH_TTL - 86400 then
    batch_expire(b, BATCH_TTL)
  end
end

-- The payload text stored at seal time, with enqueued_at spliced in as text: cjson would
-- rewrite the numbers (and empty tables) of a decoded and re-encoded payload.
local function batch_push(b, which, now)
  local raw = redis.call('HGET', b, which)
  if not raw then
    return
  end
  local q = redis.call('HGET', b, which .. '_queue')
  local job = '{"enqueued_at":' .. now .. ',' .. string.sub(raw, 2)
  local kind = redis.call('TYPE', 'queue:' .. q)['ok']
  if kind ~= 'list' and kind ~= 'none' then
    -- LPUSH would fail this whole call after the callback was marked fired (Redis keeps a
    -- failed script's writes): it would be lost for good. Parked in dead with the reason,
    -- an operator retries it once the key is fixed.
    local why = cjson.encode('queue:' .. q .. ' holds a ' .. kind .. ', not a list')
    redis.call('ZADD', 'dead', now, string.sub(job, 1, -2) ..
      ',"error_class":"forkq.CallbackUndeliverable","error_message":' .. why ..
      ',"failed_at":' .. now .. '}')
    return
  end
  redis.call('SADD', 'queues', q)
  redis.call('LPUSH', 'queue:' .. q, job)
end

-- Fire what is due, once each (complete_at / success_at mark it fired); nothing before the
-- batch is sealed. Once it succeeded nothing can change, and its keys expire a day later.
local function batch_check(b)
  local state = redis.call('HMGET', b, 'sealed', 'complete_at')
  if state[1] ~= '1' then
    return
  end
  local pending = redis.call('SCARD', b .. ':jids')
  local complete = not state[2] and redis.call('HLEN', b .. ':failed') >= pending
  local success = pending == 0 and not redis.call('HGET', b, 'success_at')
  if not (complete or success) then
    return
  end
  local t = redis.call('TIME')
  local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
  if complete then
    redis.call('HSET', b, 'complete_at', now)
    batch_push(b, 'on_complete', now)
  end
  if success then
    redis.call('HSET', b, 'success_at', now)
    batch_push(b, 'on_success', now)
    batch_expire(b, BATCH_DONE_TTL)
  end
end

-- Job `jid` of batch `b` succeeded.
local function batch_success(b, jid)
  if redis.call('SREM', b .. ':jids', jid) == 0 then
    return  -- counted before (a re-run), or not a job of this batch
  end
  redis.call('HDEL', b .. ':failed', jid)
  batch_refresh(b, b .. ':jids')
  batch_check(b)
end

-- Job `jid` of batch `b` failed (to retry, or for good): `err` is kept as its last failure.
-- Whether it counted (a job of the batch not succeeded yet); nothing is checked here.
local function batch_note_failure(b, jid, err)
  if redis.call('SISMEMBER', b .. ':jids', jid) == 0 then
    return false
  end
  redis.call('HSET', b .. ':failed', jid, err)
  return true
end

-- What follows a batch's failures: its keys' lives, and its callbacks. A call that ends
-- many jobs of one batch (forget.lua) does it once, after them all.
local function batch_failed(b)
  batch_refresh(b, b .. ':failed')
  batch_check(b)
end

local function batch_failure(b, jid, err)
  if batch_note_failure(b, jid, err) then
    batch_failed(b)
  end
end
