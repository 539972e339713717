"""The job the chaos run (tests/test_chaos.py, bench/chaos.py) enqueues, loaded with --require.

`chaos.record(n, fail_once)` sleeps 0-20 ms, then records one execution of job number n as
`HSET chaos:execs <uuid4> n`: one field per execution, so a write retried after a lost reply
(Redis restarting under it) still counts that execution once, and the count of fields per n
is exactly how many times job n ran to its end. A job with fail_once raises on its first
attempt (`HSETNX chaos:failed n`), and `retry_in` brings it back through the retry set at once
(0 s: any delay above 0 gets Sidekiq's jitter of up to 9 s), so the chaos run exercises the
retry set too without waiting on it.

Every Redis call goes to the worker's own Redis (FORKQ_REDIS_URL), through a client made per
process (nothing made before the fork is used after it).
"""

import os
import random
import time
import uuid

import redis

import forkq

EXECS = "chaos:execs"
FAILED = "chaos:failed"
_clients: dict[int, redis.Redis] = {}


class ChaosFailure(Exception):
    """The deliberate first failure of a fail_once job."""


def _client() -> redis.Redis:
    pid = os.getpid()
    c = _clients.get(pid)
    if c is None:
        c = _clients[pid] = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"], socket_timeout=5)
    return c


def _write(fn, *args):
    """Ride out a Redis restart: the writes are idempotent, so retrying them is safe."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return fn(*args)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _retry_soon(count, exc):
    return 0


@forkq.job(name="chaos.record", queue="chaos", retry=5, retry_in=_retry_soon)
def record(n, fail_once=False):
    time.sleep(random.uniform(0, 0.02))
    c = _client()
    if fail_once and _write(c.hsetnx, FAILED, str(n), 1):
        raise ChaosFailure(f"job {n} fails once on purpose")
    _write(c.hset, EXECS, uuid.uuid4().hex, n)
