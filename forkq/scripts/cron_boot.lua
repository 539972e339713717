-- A process starting its periodic entries: for each one first seen, or whose schedule
-- changed since the fleet last saw it, raise `since` to now, so that no due time from
-- before now is owed (a new entry does not fire at once for a time long past). `since`
-- only ever rises: two processes booting together cannot lower it under a due time one
-- of them has just pushed.
-- "Now" is the booting host's clock, but never past Redis's: every due time at or before
-- `since` is refused to every host (cron_push.lua), so one host whose clock ran ahead
-- would take from the whole fleet the due times between Redis's clock and its own, which
-- nobody had pushed yet. A host whose clock runs behind sets it lower, which can only
-- leave a due time owed that would not have been (pushed once, late), never lose one.
-- KEYS[i] forkq:cron:NAME of each entry (see cron_push.lua)
-- ARGV[1] now (epoch seconds), ARGV[2] seconds each hash outlives this boot,
-- ARGV[i + 2] entry i's schedule ("FIELDS TIMEZONE")
-- Returns for each entry {pushed, since}, each false when unset, then Redis's clock
-- (epoch seconds, a string), from which the host learns how far ahead its own runs.
local t = redis.call('TIME')
local clock = string.format('%d.%06d', t[1], t[2])
local now, stamp = tonumber(ARGV[1]), ARGV[1]
if not (now and now <= tonumber(clock)) then
  now, stamp = tonumber(clock), clock
end
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'spec') ~= ARGV[i + 2] then
    local since = tonumber(redis.call('HGET', key, 'since') or '')
    if not since or since < now then
      redis.call('HSET', key, 'since', stamp)
    end
    redis.call('HSET', key, 'spec', ARGV[i + 2])
  end
  redis.call('EXPIRE', key, ARGV[2])
  out[i] = redis.call('HMGET', key, 'pushed', 'since')
end
out[#KEYS + 1] = clock
return out
