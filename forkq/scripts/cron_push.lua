-- Push one periodic entry's job for one of its due times, unless that due time is already
-- done. Every forkq process running the app calls this at the same due time; Redis runs
-- one call at a time, so exactly one of them finds the due time newer than what the hash
-- holds and pushes. Marking and pushing are in the same call: a process that dies between
-- them cannot leave a due time marked with its job never pushed, or pushed and still free.
-- KEYS[1] the entry's hash forkq:cron:NAME: `pushed` (the latest due time pushed),
--   `since:SCHEDULE` (no due time of that schedule at or before it is owed: the fleet
--   first saw the schedule then, see cron_boot.lua), `jid` and `pushed_at` of the latest push
-- ARGV[1] the due time (epoch seconds), ARGV[2] the queue, ARGV[3] the payload,
-- ARGV[4] its jid, ARGV[5] now (epoch seconds), ARGV[6] seconds the hash outlives this push,
-- ARGV[7] the schedule the due time is of, ARGV[8] (absent when the entry has none) its
-- max_delay in seconds
-- Returns {1, CLOCK} if this call pushed the job, {0, CLOCK} if the due time was already
-- done, {-1, CLOCK} if it has not come yet by Redis's clock, {-2, CLOCK} if it passed
-- max_delay by Redis's clock unpushed (skipped); CLOCK is that clock (epoch seconds, a
-- string).
local t = redis.call('TIME')
local clock = string.format('%d.%06d', t[1], t[2])
local due = tonumber(ARGV[1])
-- Redis's clock is the fleet's: a host whose clock runs ahead would otherwise push a due
-- time early, and as `pushed` only rises, every due time before it that the hosts on time
-- had still to push would be refused to them
if due > tonumber(clock) then
  return {-1, clock}
end
local state = redis.call('HMGET', KEYS[1], 'pushed', 'since:' .. ARGV[7])
for i = 1, 2 do
  if state[i] and tonumber(state[i]) >= due then
    return {0, clock}
  end
end
-- max_delay is judged by the same clock, after the done check (a due time another host
-- pushed is no skip). A skip marks nothing: Redis's clock only moves on, so the due time
-- stays too late for every host that offers it later
if ARGV[8] and tonumber(clock) - due > tonumber(ARGV[8]) then
  return {-2, clock}
end
-- Sidekiq's client writes a push as these two commands: its Web UI and workers see an
-- ordinary job. The push comes before the mark: Redis does not undo a script's writes when
-- a later command fails (LPUSH onto a key that is no list), and a due time marked done
-- without its job would never be pushed; unmarked, the next check pushes it.
redis.call('SADD', 'queues', ARGV[2])
redis.call('LPUSH', 'queue:' .. ARGV[2], ARGV[3])
redis.call('HSET', KEYS[1], 'pushed', ARGV[1], 'jid', ARGV[4], 'pushed_at', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[6])
return {1, clock}
