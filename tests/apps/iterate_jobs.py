"""An iterable job for tests/test_iterate.py's master test, loaded with --require: each item
it finishes is recorded (RPUSH iter:items "ITEM PID"), so the test sees which ran where."""

import os
import time

import redis

import forkq

ITEMS = "iter:items"
_conn: list = [None, None]  # (pid, client): a client made in this process, not inherited


def _redis():
    if _conn[0] != os.getpid():
        _conn[:] = [os.getpid(), redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])]
    return _conn[1]


@forkq.job(name="iter.export", iterable=True)
def export(n, cursor=None):
    for i in range(0 if cursor is None else cursor + 1, n):
        time.sleep(0.01)
        _redis().rpush(ITEMS, f"{i} {os.getpid()}")
        yield i
