-- Count one entry in a fixed-window limiter (windows aligned to Redis's clock: a "minute"
-- bucket starts at each whole UTC minute) if the current window has room.
-- KEYS[1] the limiter's hash forkq:limiter:NAME:bucket: `w`, the current window's number
--   (epoch ms / interval ms, rounded down), and `n`, the entries admitted in it
-- ARGV[1] count, ARGV[2] interval ms
-- Returns {1, entries} when admitted, {0, entries, ms until the window ends} when full.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key = KEYS[1]
local interval = tonumber(ARGV[2])
local window = math.floor(now / interval)
local state = redis.call('HMGET', key, 'w', 'n')
local n = 0
if tonumber(state[1]) == window then
  n = tonumber(state[2]) or 0
end
local ends = (window + 1) * interval
if n >= tonumber(ARGV[1]) then
  return {0, n, ends - now}
end
redis.call('HSET', key, 'w', window, 'n', n + 1)
-- gone when its window ends: the next window starts from nothing, and an unused limiter
-- leaves nothing behind
redis.call('PEXPIREAT', key, ends)
return {1, n + 1}
