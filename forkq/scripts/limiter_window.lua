-- Count one entry in a sliding-window limiter if the window has room: one call per attempt.
-- KEYS[1] the limiter's zset forkq:limiter:NAME:window, member = an entry's token, score =
--   when it was admitted (Redis's clock, epoch ms)
-- ARGV[1] count, ARGV[2] interval ms, ARGV[3] this entry's token
-- Returns {1, entries} when admitted, {0, entries, ms until the oldest entry leaves the
-- window} when it is full.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key = KEYS[1]
local interval = tonumber(ARGV[2])
-- an entry admitted `interval` ago or earlier is out of the window
redis.call('ZREMRANGEBYSCORE', key, '-inf', now - interval)
local n = redis.call('ZCARD', key)
if n >= tonumber(ARGV[1]) then
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  return {0, n, tonumber(first[2]) + interval - now}
end
redis.call('ZADD', key, now, ARGV[3])
-- every entry has left the window once the newest has: then the key goes too
redis.call('PEXPIRE', key, interval)
return {1, n + 1}
