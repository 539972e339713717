-- A process starting its periodic entries. For each entry, the moment the fleet first saw
-- its schedule, kept as `since:SCHEDULE`: no due time at or before it is owed, so a new
-- entry, or a new schedule, does not fire at once for a time long past. One field per
-- schedule, set once and never moved: during a rolling deploy that changes an entry, hosts
-- of the old and the new schedule boot in turn, and a boot of one schedule must not mark
-- done a due time of the other that its hosts have yet to push. (A single `since`, raised
-- at each switch, did: a boot of the old schedule a moment after a due time of the new one
-- took that run from the fleet.) Schedules are few per entry; the hash expires with it.
-- "Now" is the booting host's clock, but never past Redis's: every due time at or before
-- `since:SCHEDULE` is refused to every host (cron_push.lua), so one host whose clock ran
-- ahead would take from the fleet the due times between Redis's clock and its own, which
-- nobody had pushed yet. Nor more than ARGV[3] seconds before it: a host whose clock
-- runs further behind would owe the due times between its clock and Redis's, from before
-- the fleet saw the schedule, and (set to Redis's clock by the reply) push the latest at
-- once. Within ARGV[3] (the round trip a reading taken before the call misses) it may
-- leave a due time owed that would not have been (pushed once, late), never lose one.
-- KEYS[i] forkq:cron:NAME of each entry (see cron_push.lua)
-- ARGV[1] now (epoch seconds), ARGV[2] seconds each hash outlives this boot,
-- ARGV[3] the most seconds `now` may lag Redis's clock ('' for no limit),
-- ARGV[i + 3] entry i's schedule ("FIELDS TIMEZONE")
-- Returns for each entry {pushed, since}, each false when unset, then Redis's clock
-- (epoch seconds, a string), from which the host learns how far ahead its own runs.
local t = redis.call('TIME')
local clock = string.format('%d.%06d', t[1], t[2])
local stamp = ARGV[1]
local now = tonumber(stamp)
local lag = tonumber(ARGV[3])
if not (now and now <= tonumber(clock)) or (lag and now < tonumber(clock) - lag) then
  stamp = clock
end
local out = {}
for i, key in ipairs(KEYS) do
  local field = 'since:' .. ARGV[i + 3]
  redis.call('HSETNX', key, field, stamp)
  redis.call('EXPIRE', key, ARGV[2])
  out[i] = redis.call('HMGET', key, 'pushed', field)
end
out[#KEYS + 1] = clock
return out
