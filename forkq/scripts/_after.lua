-- A succeeded job's after-success actions, (key, jid) pairs in args[first..last], run in
-- the call that acknowledges the job: a unique job's lock, deleted if it still holds the
-- jid.
local function after_success(args, first, last)
  for i = first, last, 2 do
    if redis.call('GET', args[i]) == args[i + 1] then
      redis.call('DEL', args[i])
    end
  end
end
