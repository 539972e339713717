-- Remove entries an operator deletes (forkq dead/queues, forkq.api, the dashboard), and
-- end each one this call removed as a job leaving for good ends: release its unique lock,
-- while it still holds the jid, and count it as failed in its batch, so that the batch's
-- `complete` can fire (its success never will). Only for an entry this call took out: one
-- another process moved meanwhile (the scheduler, a worker's claim) is still a pending job.
-- KEYS[1] the sorted set or the queue list
-- ARGV[1] 'zset' or 'list', ARGV[2] the failure a batch records (JSON), then
-- (member, lock key or '', jid, batch key or '') quadruplets
-- Returns how many entries were removed.
-- Each batch is checked once, after all its entries: a clear's page of 1,000 entries of
-- one batch checked it 1,000 times (about half the call's time).
--#include batch
--#include unlock
local removed = 0
local zset = ARGV[1] == 'zset'
local failed, order = {}, {}
for i = 3, #ARGV, 4 do
  local n
  if zset then
    n = redis.call('ZREM', KEYS[1], ARGV[i])
  else
    n = redis.call('LREM', KEYS[1], 1, ARGV[i])
  end
  if n > 0 then
    removed = removed + n
    if ARGV[i + 1] ~= '' then
      unlock(ARGV, i + 1, i + 2)
    end
    local b = ARGV[i + 3]
    if b ~= '' and batch_note_failure(b, ARGV[i + 2], ARGV[2]) and not failed[b] then
      failed[b] = true
      order[#order + 1] = b
    end
  end
end
for _, b in ipairs(order) do
  batch_failed(b)
end
return removed
