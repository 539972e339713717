"""Iterable jobs that SIGKILL their own process, for tests/test_iterate_crash.py's master
test, loaded with --require. Each run records "TAG CURSOR PID" (RPUSH itc:runs). Every
yield writes the checkpoint here (FLUSH_S 0), so a death right after one has moved it."""

import os
import signal

import redis

import forkq
from forkq import iterate

iterate.FLUSH_S = 0.0
RUNS = "itc:runs"
_conn: list = [None, None]  # (pid, client): a client made in this process, not inherited


def _redis():
    if _conn[0] != os.getpid():
        _conn[:] = [os.getpid(), redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])]
    return _conn[1]


@forkq.job(name="itc.steps", iterable=True)
def steps(n, cursor=None):
    """One item a run, then its process dies: n - 1 deaths, each further on."""
    at = cursor or 0
    _redis().rpush(RUNS, f"steps {at} {os.getpid()}")
    yield at + 1
    if at + 1 < n:
        os.kill(os.getpid(), signal.SIGKILL)


@forkq.job(name="itc.stuck", iterable=True)
def stuck(cursor=None):
    """Its process dies after each run's first item, whose cursor is always the same: the
    checkpoint is rewritten at every run and never moves."""
    _redis().rpush(RUNS, f"stuck {cursor} {os.getpid()}")
    yield 7
    os.kill(os.getpid(), signal.SIGKILL)
