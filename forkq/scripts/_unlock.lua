-- Delete each lock of the (lock key, jid) pairs in args[first..last] that still holds its jid.
local function unlock(args, first, last)
  for i = first, last, 2 do
    if redis.call('GET', args[i]) == args[i + 1] then
      redis.call('DEL', args[i])
    end
  end
end
