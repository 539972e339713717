"""What the apps that record their runs (bench/chaos_app.py, tests/apps/chaos_jobs.py,
tests/apps/redisops_jobs.py) share: a Redis client per process, and a write that rides out
a Redis restart or pause.

Each is loaded by `--require` path into a master started with the repository on PYTHONPATH
(bench.common.start_master, bench.chaos's soak, tests/test_redis_ops.py), so `bench`, a
package, is importable there; `tests` is only a namespace package, which any installed
`tests` package would hide.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import redis

T = TypeVar("T")
_clients: dict[tuple[int, str], redis.Redis] = {}


def client(url_variable: str = "FORKQ_REDIS_URL") -> redis.Redis:
    """This process's client to the Redis the environment variable names (one made before
    a fork is never used after it)."""
    key = (os.getpid(), url_variable)
    c = _clients.get(key)
    if c is None:
        c = _clients[key] = redis.Redis.from_url(os.environ[url_variable], socket_timeout=5)
    return c


def write(fn: Callable[..., T], *args: object) -> T:
    """Call fn(*args) until Redis takes it (60 s at most): only for idempotent writes, as a
    reply lost in a restart makes the retry send the write a second time."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return fn(*args)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
