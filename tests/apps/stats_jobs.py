"""Jobs for tests/test_stats_crash.py, loaded with --require.

Each run appends "PID EPOCH OUTCOME" to stats:runs on the worker's Redis as its last act
(just before returning or raising), so a test can compare what actually ran with what
`stat:processed` and `stat:failed` say, and tell which child ran what and when. With
STATS_RECORD_URL set, the runs go to that Redis instead (one the test keeps writable).
"""

import os
import time

import redis

import forkq

RUNS = "stats:runs"
STARTED = "stats:started"  # the n of each long_tick as it starts
_client: redis.Redis | None = None
_client_pid = 0


def _redis() -> redis.Redis:
    # one client per process, made after the fork: a pool must not cross it
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        _client = redis.Redis.from_url(os.environ.get("STATS_RECORD_URL") or os.environ["FORKQ_REDIS_URL"])
        _client_pid = os.getpid()
    return _client


@forkq.job(name="stats.tick", retry=False)
def tick(n, seconds=0.002):
    """Sleeps `seconds`, records its run; every tenth (n % 10 == 0) then fails."""
    time.sleep(seconds)
    fails = n % 10 == 0
    _redis().rpush(RUNS, f"{os.getpid()} {time.time():.6f} {'fail' if fails else 'ok'}")
    if fails:
        raise RuntimeError(f"tick {n} fails on purpose")


@forkq.job(name="stats.long_tick", retry=False)
def long_tick(n, seconds):
    """As tick, recording its start too: a test can tell a job that runs from one that a
    claim only brought in flight (a stop gives the latter back unstarted)."""
    _redis().rpush(STARTED, n)
    tick(n, seconds)
