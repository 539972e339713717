"""The job the chaos run (tests/test_chaos.py, bench/chaos.py) enqueues, loaded with --require.

`chaos.record(n, fail_once)` sleeps 0-20 ms, then records one execution of job number n as
`HSET chaos:execs <uuid4> n`: one field per execution, so a write retried after a lost reply
(Redis restarting under it) still counts that execution once, and the count of fields per n
is exactly how many times job n ran to its end. A job with fail_once raises on its first
attempt (`HSETNX chaos:failed n`), and `retry_in` brings it back through the retry set at once
(0 s: any delay above 0 gets Sidekiq's jitter of up to 9 s), so the chaos run exercises the
retry set too without waiting on it.

Every Redis call goes to the worker's own Redis (FORKQ_REDIS_URL), through bench/jobkit.py's
client per process.
"""

import random
import time
import uuid

import forkq
from bench.jobkit import client, write

EXECS = "chaos:execs"
FAILED = "chaos:failed"


class ChaosFailure(Exception):
    """The deliberate first failure of a fail_once job."""


def _retry_soon(count, exc):
    return 0


@forkq.job(name="chaos.record", queue="chaos", retry=5, retry_in=_retry_soon)
def record(n, fail_once=False):
    time.sleep(random.uniform(0, 0.02))
    c = client()
    if fail_once and write(c.hsetnx, FAILED, str(n), 1):
        raise ChaosFailure(f"job {n} fails once on purpose")
    write(c.hset, EXECS, uuid.uuid4().hex, n)
