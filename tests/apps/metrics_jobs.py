"""Jobs for the metrics tests (tests/test_metrics.py), loaded with --require.

Classes apart on purpose, so counts by class can be told apart: `metrics.ok` succeeds
(after sleeping a given time, for the histogram), `metrics.boom` raises, `metrics.hold`
sleeps long enough to be in flight when a test kills its child. None retries: a failure
counts once and leaves nothing in the retry set to run again.
"""

import os
import time

import redis

import forkq

PIDS = "metrics:pids"


@forkq.job(name="metrics.ok", retry=False)
def ok(seconds=0.0):
    """Records which process ran it (RPUSH metrics:pids), so a test knows both children worked."""
    if seconds:
        time.sleep(seconds)
    client = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])  # made after the fork
    try:
        client.rpush(PIDS, os.getpid())
    finally:
        client.close()


@forkq.job(name="metrics.boom", retry=False)
def boom():
    raise RuntimeError("boom, on purpose")


@forkq.job(name="metrics.hold", retry=False)
def hold(seconds=60.0):
    time.sleep(seconds)
