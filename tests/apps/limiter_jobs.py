"""Jobs for tests/test_limiter.py's end-to-end test, loaded with --require.

The limiter is made at import, in the master, and used there once, so its client holds a
connection from before the fork: each child must open its own. LIM_OVERLIMIT_FIRST_S in
the environment shortens the first wait of a job rescheduled for OverLimit.
"""

import os
import time

import redis

import forkq
import forkq.limiter
import forkq.retry

if os.environ.get("LIM_OVERLIMIT_FIRST_S"):
    forkq.retry.OVERLIMIT_FIRST_S = float(os.environ["LIM_OVERLIMIT_FIRST_S"])

HOLDERS = "lim:holders"   # how many run inside the limiter now
SEEN = "lim:seen"         # HOLDERS as each holder found it on entry
DONE = "lim:done"         # "tag pid" of each job that finished

slots = forkq.limiter.concurrent("e2e", 2, wait_timeout=0.05, lock_timeout=10)
slots._redis().ping()  # a connection in the master, before the fork


@forkq.job(name="lim.hold")
def hold(tag: str) -> None:
    r = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])
    try:
        with slots:
            r.rpush(SEEN, r.incr(HOLDERS))
            time.sleep(0.1)
            r.decr(HOLDERS)
        r.rpush(DONE, f"{tag} {os.getpid()}")
    finally:
        r.close()
