"""The job of tests/test_redis_ops.py, loaded with --require.

`ops.hold(n)` waits while the key `ops:hold` exists, then records one run of job n as
`HSET ops:runs <uuid4> n`. Both live on the Redis that OPS_RECORD_URL names, not on the
worker's: the tests make the worker's Redis answer BUSY or refuse commands, and a job's
own bookkeeping must neither fail with it nor be counted in its command statistics.
"""

import time
import uuid

import forkq
from bench.jobkit import client

HOLD = "ops:hold"
RUNS = "ops:runs"


@forkq.job(name="ops.hold", queue="ops", retry=0)
def hold(n: int) -> None:
    c = client("OPS_RECORD_URL")
    while c.exists(HOLD):
        time.sleep(0.02)
    c.hset(RUNS, uuid.uuid4().hex, n)
