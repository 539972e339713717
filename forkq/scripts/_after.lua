-- The body of after_success(args, first, last), pasted in where a script defines it:
--
--   local function after_success(args, first, last)
--   --#include batch
--   --#include after
--   end
--
-- A succeeded job's after-success actions, (key, jid) pairs in args[first..last], run in
-- the call that acknowledges the job: a batch key ("forkq:batch:BID") counts the job's
-- success in its batch; "forkq:iter:JID" is an iterable job's checkpoint, deleted; any
-- other key is a unique job's lock, deleted if it still holds the jid. Inside the function, the batch helpers are made only by calls that have
-- actions: defined at the top of fetch.lua they cost every claim about 5,700 Redis
-- instructions (3%, bench/redis_cost.py).
for i = first, last, 2 do
  local k = args[i]
  if string.sub(k, 1, 12) == 'forkq:batch:' then
    batch_success(k, args[i + 1])
  elseif string.sub(k, 1, 11) == 'forkq:iter:' then
    redis.call('DEL', k)  -- an iterable job's checkpoint: it ran to its end
  elseif redis.call('GET', k) == args[i + 1] then
    redis.call('DEL', k)
  end
end
