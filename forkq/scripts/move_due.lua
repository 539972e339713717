-- Move due jobs from a sorted set (schedule or retry) onto their queues. The caller read
-- them and prepared the payload to push (with enqueued_at set); ZREM guards each move so
-- two pollers racing for one job move it once, and until this script runs the job stays
-- in the sorted set: it is never only in a client's memory.
-- KEYS[1] the sorted set; ARGV triples: member, queue name, payload to push.
-- A queue key that holds something other than a list would fail the LPUSH after the ZREM,
-- and Redis keeps a failed script's writes: the job would be in neither place. Such a job
-- goes to dead instead, its member kept with the reason, for an operator to retry once the
-- key is fixed; from dead itself (a retry-now) it stays where it is.
-- Returns how many jobs went onto their queues.
local moved = 0
local kinds = {}  -- queue name -> the type of its key, looked up once
local now
for i = 1, #ARGV, 3 do
  local name = ARGV[i + 1]
  local kind = kinds[name]
  if kind == nil then
    kind = redis.call('TYPE', 'queue:' .. name)['ok']
    kinds[name] = kind
  end
  if kind == 'list' or kind == 'none' then
    if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
      redis.call('SADD', 'queues', name)
      redis.call('LPUSH', 'queue:' .. name, ARGV[i + 2])
      moved = moved + 1
    end
  elseif KEYS[1] ~= 'dead' and redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    if not now then
      local t = redis.call('TIME')
      now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
    end
    -- the member's own text with the reason appended (cjson would rewrite its numbers);
    -- a key it already has (error_class after a failure) is written twice, and JSON
    -- readers keep the last
    local why = 'queue:' .. name .. ' holds a ' .. kind .. ', not a list: the job could not be pushed onto it'
    redis.call('ZADD', 'dead', now, string.gsub(ARGV[i], '%s*}%s*$', '')
      .. ',"error_class":"forkq.QueueNotAList","error_message":' .. cjson.encode(why) .. '}')
  end
end
return moved
