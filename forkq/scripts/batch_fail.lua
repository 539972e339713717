-- Count a batch job's failure in its batch (queued in the MULTI that schedules its retry or
-- ends it, see forkq.batch.on_failure); `complete` may fire here.
-- KEYS[1] the batch hash, ARGV[1] the jid, ARGV[2] its failure as JSON
--#include batch
batch_failure(KEYS[1], ARGV[1], ARGV[2])
return 1
