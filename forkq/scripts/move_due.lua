-- Move due jobs from a sorted set (schedule or retry) onto their queues. The caller read
-- them and prepared the payload to push (with enqueued_at set); ZREM guards each move so
-- two pollers racing for one job move it once, and until this script runs the job stays
-- in the sorted set: it is never only in a client's memory.
-- KEYS[1] the sorted set; ARGV triples: member, queue name, payload to push.
local moved = 0
for i = 1, #ARGV, 3 do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    redis.call('SADD', 'queues', ARGV[i + 1])
    redis.call('LPUSH', 'queue:' .. ARGV[i + 1], ARGV[i + 2])
    moved = moved + 1
  end
end
return moved
