-- A process starting its periodic entries: for each one first seen, or whose schedule
-- changed since the fleet last saw it, raise `since` to now, so that no due time from
-- before now is owed (a new entry does not fire at once for a time long past). `since`
-- only ever rises: two processes booting together cannot lower it under a due time one
-- of them has just pushed.
-- KEYS[i] forkq:cron:NAME of each entry (see cron_push.lua)
-- ARGV[1] now (epoch seconds), ARGV[2] seconds each hash outlives this boot,
-- ARGV[i + 2] entry i's schedule ("FIELDS TIMEZONE")
-- Returns for each entry {pushed, since}, each false when unset.
local now = tonumber(ARGV[1])
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'spec') ~= ARGV[i + 2] then
    local since = tonumber(redis.call('HGET', key, 'since') or '')
    if not since or since < now then
      redis.call('HSET', key, 'since', ARGV[1])
    end
    redis.call('HSET', key, 'spec', ARGV[i + 2])
  end
  redis.call('EXPIRE', key, ARGV[2])
  out[i] = redis.call('HMGET', key, 'pushed', 'since')
end
return out
