-- Mark a batch abandoned (an exception left its `with`), if its hash is still there: a
-- plain HSET on a batch whose keys had expired (a `with` held open past the TTL, an
-- eviction, a FLUSHDB) made a hash of one field with no TTL, left in Redis for good.
-- KEYS[1] the batch hash
-- Reply: 1 marked, 0 no such batch.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'abandoned', '1')
return 1
