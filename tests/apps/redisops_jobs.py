"""The job of tests/test_redis_ops.py, loaded with --require.

`ops.hold(n)` waits while the key `ops:hold` exists, then records one run of job n as
`HSET ops:runs <uuid4> n`. Both live on the Redis that OPS_RECORD_URL names, not on the
worker's: the tests make the worker's Redis answer BUSY or refuse commands, and a job's
own bookkeeping must neither fail with it nor be counted in its command statistics.
"""

import os
import time
import uuid

import redis

import forkq

HOLD = "ops:hold"
RUNS = "ops:runs"
_clients: dict[int, redis.Redis] = {}


def _client() -> redis.Redis:
    pid = os.getpid()
    c = _clients.get(pid)
    if c is None:
        c = _clients[pid] = redis.Redis.from_url(os.environ["OPS_RECORD_URL"], socket_timeout=5)
    return c


@forkq.job(name="ops.hold", queue="ops", retry=0)
def hold(n: int) -> None:
    c = _client()
    while c.exists(HOLD):
        time.sleep(0.02)
    c.hset(RUNS, uuid.uuid4().hex, n)
